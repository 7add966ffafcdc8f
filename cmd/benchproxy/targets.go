package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/semroute/semroute/internal/httpserve"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/simreplica"
)

// target is one server under test: its name in the table, where it
// listens, and the processes whose CPU it spends.
type target struct {
	name, url string
	pids      func() []int
}

// startTargets starts the servers under test, each in its own processes:
// the replica, then in front of it the plain proxy, the router, and nginx
// unless o.nginx is "off" or it is not installed (out is told). stop ends
// them, the last started first.
func startTargets(out io.Writer, o options) (targets []target, stop func(), err error) {
	var stops []func()
	stopAll := func() {
		for _, s := range slices.Backward(stops) {
			s()
		}
	}
	defer func() {
		if err != nil {
			stopAll()
		}
	}()
	bin, removeBin, err := routerBinary(o.router)
	if err != nil {
		return nil, nil, err
	}
	stops = append(stops, removeBin)
	// started records a target started (or fails with err): in the table,
	// and stopped with the others.
	started := func(name string) func(url string, pid int, stop func(), err error) error {
		return func(url string, pid int, stop func(), err error) error {
			if err != nil {
				return fmt.Errorf("starting the %s: %w", name, err)
			}
			stops = append(stops, stop)
			targets = append(targets, target{name, url, func() []int { return []int{pid} }})
			return nil
		}
	}
	if err := started("replica")(startChild("replica", "")); err != nil {
		return nil, nil, err
	}
	replica := targets[0].url
	if err := started("plain proxy")(startChild("plain", replica)); err != nil {
		return nil, nil, err
	}
	if err := started("router")(startRouter(bin, replica, o.cpuProfile)); err != nil {
		return nil, nil, err
	}
	if o.nginx == "off" {
		return targets, stopAll, nil
	}
	nginx, err := findNginx(o.nginx)
	if err != nil {
		return nil, nil, err
	}
	if nginx == "" {
		fmt.Fprintln(out, "nginx: not found (deploy/bench/install-nginx.sh installs it); measuring without it")
		return targets, stopAll, nil
	}
	u, pids, stopNginx, err := startNginx(nginx, replica)
	if err != nil {
		return nil, nil, fmt.Errorf("starting nginx: %w", err)
	}
	stops = append(stops, stopNginx)
	// Beside the router: the comparison the table is read for.
	return slices.Insert(targets, 2, target{"nginx", u, pids}), stopAll, nil
}

// process is a child process of the benchmark.
type process struct {
	cmd    *exec.Cmd
	end    func()        // asks it to end
	exited chan struct{} // closed once it has exited; err is then its Wait's
	err    error
}

// startProcess starts cmd; end is how to ask it to end.
func startProcess(cmd *exec.Cmd, end func()) (*process, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, end: end, exited: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.exited) }()
	return p, nil
}

// stop asks the process to end and waits for it 10 s, then kills it.
func (p *process) stop() {
	p.end()
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// waitListening waits until addr accepts connections, for up to within;
// it fails sooner if p exits.
func (p *process) waitListening(addr string, within time.Duration) error {
	for deadline := time.Now().Add(within); ; {
		if c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("exited (%v) before listening on %s", p.err, addr)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("did not listen on %s within %v", addr, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freeAddr returns a free port's address on 127.0.0.1, for a server that
// cannot say which port it picked (another process may take it first).
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startChild runs this command as `benchproxy --serve-target role` in a
// child process and returns the URL it serves. stop closes the child's
// stdin, which ends it, and waits; a child whose parent dies sees the same
// end of input.
func startChild(role, upstream string) (url string, pid int, stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return "", 0, nil, err
	}
	cmd := exec.Command(exe, "--serve-target", role, "--upstream", upstream)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return "", 0, nil, err
	}
	// Its stdout is a pipe of this process's own (not cmd.StdoutPipe,
	// which Wait closes): the URL is read while Wait waits.
	outR, outW, err := os.Pipe()
	if err != nil {
		return "", 0, nil, err
	}
	cmd.Stdout = outW
	p, err := startProcess(cmd, func() { in.Close() })
	outW.Close() // the child's copy is its own
	if err != nil {
		outR.Close()
		return "", 0, nil, err
	}
	line := make(chan string, 1)
	go func() {
		defer outR.Close()
		sc := bufio.NewScanner(outR)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, outR)
	}()
	select {
	case u, ok := <-line:
		if ok && strings.HasPrefix(u, "http://") {
			return u, cmd.Process.Pid, p.stop, nil
		}
		p.stop()
		return "", 0, nil, fmt.Errorf("the %s process printed %q, not its URL", role, u)
	case <-time.After(30 * time.Second):
		p.stop()
		return "", 0, nil, fmt.Errorf("the %s process did not start within 30s", role)
	}
}

// serveTarget serves one benchmark target in this process, the replica or
// the plain proxy in front of upstream, prints its URL, and serves until
// in ends.
func serveTarget(role, upstream string, out io.Writer, in io.Reader) error {
	var (
		u    string
		stop func()
	)
	switch role {
	case "replica":
		sim, err := simreplica.Start(simreplica.Options{Overhead: -1, PrefillPerToken: -1, InterToken: -1, MaxRunning: 4096, OutputTokens: 8}, "127.0.0.1:0")
		if err != nil {
			return err
		}
		u, stop = sim.URL, func() { _ = sim.Close() }
	case "plain":
		proxy, err := plainProxy(upstream)
		if err != nil {
			return err
		}
		s, err := httpserve.Serve("127.0.0.1:0", proxy, slog.New(slog.DiscardHandler)) // served as the router is
		if err != nil {
			return err
		}
		u, stop = s.URL(), func() { _ = s.Stop(5 * time.Second) }
	default:
		return fmt.Errorf("--serve-target %q: want replica or plain", role)
	}
	defer stop()
	fmt.Fprintln(out, u)
	_, _ = io.Copy(io.Discard, in)
	return nil
}

// plainProxy returns a reverse proxy to upstream with the router's proxy
// settings, without routing.
func plainProxy(upstream string) (*httputil.ReverseProxy, error) {
	target, err := neturl.Parse(upstream)
	if err != nil || target.Host == "" {
		return nil, fmt.Errorf("--upstream %q is not a URL", upstream)
	}
	t := http.DefaultTransport.(*http.Transport).Clone() // as the router's
	t.MaxIdleConnsPerHost = 256
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
			// The transport reads once more after Content-Length bytes to
			// see the end of the body; the server may close the body as
			// soon as response headers go out (a stream's come at once),
			// and that read's error then closes the upstream connection
			// mid-response. Ending the body at its length avoids the race
			// and still streams it.
			if n := pr.In.ContentLength; n > 0 {
				pr.Out.Body = io.NopCloser(io.LimitReader(pr.In.Body, n))
			}
		},
		FlushInterval: 0, // as the router's
		BufferPool:    router.NewBufferPool(),
		Transport:     t,
		ErrorLog:      log.New(io.Discard, "", 0),
	}, nil
}

// routerPackage is the router's command, which routerBinary builds.
const routerPackage = "github.com/semroute/semroute/cmd/router"

// routerBinary returns the router binary to measure: path (a name
// without a slash is looked up in $PATH), or with path "" one built from
// this module (go build, run from within it) into a temporary directory,
// which remove removes.
func routerBinary(path string) (bin string, remove func(), err error) {
	if path != "" {
		if bin, err = exec.LookPath(path); err != nil {
			return "", nil, fmt.Errorf("--router %s: %w", path, err)
		}
		return bin, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "semroute-benchproxy")
	if err != nil {
		return "", nil, err
	}
	bin = filepath.Join(dir, "router")
	if out, err := exec.Command("go", "build", "-o", bin, routerPackage).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("building the router (go build %s; --router names a binary instead): %w\n%s", routerPackage, err, out)
	}
	return bin, func() { os.RemoveAll(dir) }, nil
}

// startRouter runs the router binary bin as a user would, `router serve`,
// in front of upstream on a free port of 127.0.0.1: the defaults (the GC
// floor included), the one replica, its log written to the null device
// (the request log line is formatted and written, to nowhere) and, with
// profile set, its CPU profile written there until it stops. stop sends
// SIGTERM (the router shuts down gracefully) and waits.
func startRouter(bin, upstream, profile string) (url string, pid int, stop func(), err error) {
	dir, err := os.MkdirTemp("", "semroute-benchproxy")
	if err != nil {
		return "", 0, nil, err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	cfg := filepath.Join(dir, "router.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, "replicas:\n  - name: sim\n    url: %q\n", upstream), 0o600); err != nil {
		return "", 0, nil, err
	}
	addr, err := freeAddr()
	if err != nil {
		return "", 0, nil, err
	}
	args := []string{"serve", "--config", cfg, "--listen", addr}
	if profile != "" {
		args = append(args, "--cpuprofile", profile)
	}
	cmd := exec.Command(bin, args...) // stdout and stderr: the null device
	p, err := startProcess(cmd, func() { _ = cmd.Process.Signal(syscall.SIGTERM) })
	if err != nil {
		return "", 0, nil, err
	}
	if err := p.waitListening(addr, 30*time.Second); err != nil {
		p.stop()
		return "", 0, nil, fmt.Errorf("%s %w (its log is discarded)", strings.Join(cmd.Args, " "), err)
	}
	return "http://" + addr, cmd.Process.Pid, func() { p.stop(); os.RemoveAll(dir) }, nil
}

// cpuTime returns the user and system CPU time the processes pids have
// spent, from /proc/PID/stat (utime and stime, in clock ticks of 1/100 s:
// Linux's USER_HZ); false where /proc cannot tell (not Linux).
func cpuTime(pids []int) (time.Duration, bool) {
	var total time.Duration
	for _, pid := range pids {
		f := procStat(pid)
		if len(f) < 13 {
			return 0, false
		}
		var ut, st int64
		fmt.Sscan(f[11], &ut) // field 14, utime
		fmt.Sscan(f[12], &st) // field 15, stime
		total += time.Duration(ut+st) * 10 * time.Millisecond
	}
	return total, true
}

// findNginx returns the nginx binary to measure: --nginx's path, or with
// "auto" the one on PATH or at /usr/sbin/nginx, or "" when there is none.
func findNginx(flag string) (string, error) {
	if flag != "auto" {
		if _, err := os.Stat(flag); err != nil {
			return "", fmt.Errorf("--nginx %s: %w", flag, err)
		}
		return flag, nil
	}
	if p, err := exec.LookPath("nginx"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
		return "/usr/sbin/nginx", nil
	}
	return "", nil
}

// nginxConf is nginx as a user would put it in front of vLLM: keep-alive
// connections to the upstream, no response buffering (streams pass at
// once), request bodies held in memory, no access log (the router's request
// log is off in the benchmark too). %[1]s is the prefix directory, %[2]s
// the listen address, %[3]s the upstream host:port.
const nginxConf = `daemon off;
worker_processes auto;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    keepalive_requests 1000000;
    upstream replica {
        server %[3]s;
        keepalive 256;
        keepalive_requests 1000000;
    }
    server {
        listen %[2]s;
        location / {
            proxy_pass http://replica;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
`

// startNginx runs nginx in front of upstream on a free port of 127.0.0.1,
// with its own prefix directory; pids lists its master and workers.
func startNginx(bin, upstream string) (url string, pids func() []int, stop func(), err error) {
	dir, err := os.MkdirTemp("", "semroute-nginx")
	if err != nil {
		return "", nil, nil, err
	}
	// nginx's workers run as an unprivileged user when it starts as root:
	// they must reach the body and proxy directories under the prefix.
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", nil, nil, err
	}
	addr, err := freeAddr()
	if err != nil {
		return "", nil, nil, err
	}
	up, err := neturl.Parse(upstream)
	if err != nil {
		return "", nil, nil, err
	}
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(nginxConf, dir, addr, up.Host)), 0o600); err != nil {
		return "", nil, nil, err
	}
	cmd := exec.Command(bin, "-p", dir, "-c", conf, "-e", filepath.Join(dir, "error.log"))
	cmd.Stderr = os.Stderr
	p, err := startProcess(cmd, func() { _ = cmd.Process.Signal(syscall.SIGQUIT) }) // graceful: the workers end too
	if err != nil {
		return "", nil, nil, err
	}
	stop = func() {
		p.stop()
		os.RemoveAll(dir)
	}
	master := cmd.Process.Pid
	pids = func() []int { return append([]int{master}, childPIDs(master)...) }
	if err := p.waitListening(addr, 10*time.Second); err != nil {
		stop()
		return "", nil, nil, fmt.Errorf("nginx %w (see %s/error.log)", err, dir)
	}
	return "http://" + addr, pids, stop, nil
}

// procStat returns the fields of /proc/PID/stat after the command name
// (field 3, the state, first), or nil. The name may hold spaces and
// parentheses: the fields start after its last ')'.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	i := bytes.LastIndexByte(b, ')')
	if err != nil || i < 0 || i+2 > len(b) {
		return nil
	}
	return strings.Fields(string(b[i+2:]))
}

// childPIDs returns the processes whose parent is pid (nginx's workers).
func childPIDs(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		var p int
		if _, err := fmt.Sscan(e.Name(), &p); err != nil {
			continue
		}
		f := procStat(p)
		var ppid int
		if len(f) > 1 {
			fmt.Sscan(f[1], &ppid)
		}
		if ppid == pid {
			out = append(out, p)
		}
	}
	return out
}
