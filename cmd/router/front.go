package main

import (
	"bytes"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
)

// front is the demo's stand-in for a Kubernetes Service in front of a
// fleet of routers: each request goes to the next router in turn, and to
// the one after it if that router cannot be reached (nothing was sent to
// it yet). It is for the demo and tests, not production: a real fleet sits
// behind the platform's load balancer.
type front struct {
	routers []*url.URL
	next    atomic.Uint64
	proxy   *httputil.ReverseProxy
}

// maxFrontBody bounds the request body the front keeps to try another
// router.
const maxFrontBody = 64 << 20

// newFront returns a round-robin front over the routers' base URLs.
func newFront(urls []string) http.Handler {
	f := &front{}
	for _, u := range urls {
		pu, err := url.Parse(u)
		if err != nil {
			panic(err) // the demo's own listeners' URLs
		}
		f.routers = append(f.routers, pu)
	}
	f.proxy = &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(f.routers[0]); r.Out.Host = r.In.Host }, // RoundTrip picks the router
		FlushInterval: -1,
		Transport:     f,
		ErrorLog:      log.New(io.Discard, "", 0), // a router killed mid-response: the client sees it
	}
	return f
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxFrontBody))
	if err != nil {
		http.Error(w, err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	f.proxy.ServeHTTP(w, r)
}

// RoundTrip sends req to the routers in turn, from the next one, until one
// answers.
func (f *front) RoundTrip(req *http.Request) (*http.Response, error) {
	start := f.next.Add(1)
	var last error
	for i := range uint64(len(f.routers)) {
		u := f.routers[(start+i)%uint64(len(f.routers))]
		out := req.Clone(req.Context())
		out.URL.Scheme, out.URL.Host = u.Scheme, u.Host
		if req.GetBody != nil {
			out.Body, _ = req.GetBody()
		}
		resp, err := http.DefaultTransport.RoundTrip(out)
		if err == nil {
			return resp, nil
		}
		last = err
		if req.Context().Err() != nil {
			break
		}
	}
	return nil, errors.Join(errors.New("no router answered"), last)
}
