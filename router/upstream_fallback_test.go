package router

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestUpstreamFailoverOfEmptyBodyGoesToFallback: failover sets a body reader
// on the next attempt even when the body is empty (ContentLength 0), and
// upstream.serves sends a non-nil body of length 0 to the fallback: the
// attempt after a failover goes through http.Transport (seen by the
// Accept-Encoding: gzip it adds), with its own pool, and a POST's empty body
// goes chunked. Now an empty body is no body, on every attempt.
func TestUpstreamFailoverOfEmptyBodyGoesToFallback(t *testing.T) {
	var seen []string
	var n int
	h := func(name string, _ int) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			n++
			code := 200
			if n%2 == 1 { // every other answer, whichever replica: the first attempt fails over
				code = 503
			}
			seen = append(seen, name+" "+r.Method+" ae="+r.Header.Get("Accept-Encoding")+" te="+r.Header.Get("Transfer-Encoding")+" "+http.StatusText(code))
			w.WriteHeader(code)
		}
	}
	bad := httptest.NewServer(h("bad", 503))
	defer bad.Close()
	good := httptest.NewServer(h("good", 200))
	defer good.Close()
	ts, _ := serverFor(t, ServerOptions{}, bad.URL, good.URL)
	c := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	for _, m := range []string{"GET", "POST", "GET", "POST"} {
		req, _ := http.NewRequest(m, ts.URL+"/v1/files", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	for _, s := range seen {
		if strings.Contains(s, "ae=gzip") || strings.Contains(s, "te=chunked") {
			t.Errorf("an attempt went through http.Transport: %s", s)
		}
	}
}
