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

# Regenerate the gRPC code (committed; building needs no protoc). Needs
# protoc (Debian: protobuf-compiler); the Go plugins are installed here.
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
GOBIN := $(shell go env GOPATH)/bin

.PHONY: proto
proto:
	go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	PATH="$(GOBIN):$$PATH" protoc --go_out=. --go_opt=paths=source_relative \
		--go-grpc_out=. --go-grpc_opt=paths=source_relative \
		api/proto/semroute/v1/router.proto
