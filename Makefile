# Everything builds and tests with plain `go`; these targets are shortcuts.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)

.PHONY: build test bench ci
build:
	go build -buildvcs=true -ldflags "$(LDFLAGS)" -o bin/router ./cmd/router

test:
	go test -race ./...

bench:
	go test -run '^$$' -bench . -benchtime 200x ./router ./cachemodel ./blockhash

ci:
	bash .ci/run
