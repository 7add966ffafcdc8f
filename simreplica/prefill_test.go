package simreplica

import (
	"context"
	"fmt"
	"testing"

	"github.com/semroute/semroute/internal/testwait"
)

// A waiter that gives up leaves the queue; the turn passes in arrival
// order to the ones that stayed.
func TestPrefillQueueOrderAndCancel(t *testing.T) {
	var p prefillQueue
	if !p.acquire(context.Background()) {
		t.Fatal("an idle queue refused")
	}
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan bool)
	go func() { gaveUp <- p.acquire(ctx) }()
	order := make(chan int, 2)
	for i := range 2 {
		waitQueued(t, &p, i+1)
		go func() {
			if p.acquire(context.Background()) {
				order <- i
				p.release()
			}
		}()
	}
	waitQueued(t, &p, 3)
	cancel()
	if <-gaveUp {
		t.Fatal("a cancelled waiter got the turn")
	}
	p.release()
	if a, b := <-order, <-order; a != 0 || b != 1 {
		t.Fatalf("turns went %d then %d", a, b)
	}
	if !p.acquire(context.Background()) {
		t.Fatal("the queue was not left idle")
	}
}

func waitQueued(t *testing.T, p *prefillQueue, n int) {
	t.Helper()
	testwait.Value(t, fmt.Sprint(n, " waiting"), func() (int, bool) {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.q), len(p.q) == n
	})
}
