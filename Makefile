# Everything builds and tests with plain `go`; these targets are shortcuts.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS := -X main.version=$(VERSION) -X main.commitFlag=$(COMMIT)
# Every timestamp in the image: the commit's time, so a rebuild of the same
# commit gives the same digest.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
IMAGE ?= ghcr.io/semroute/semroute
CRANE := go run github.com/google/go-containerregistry/cmd/crane@v0.22.1

.PHONY: build test bench ci image push
build:
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $(LDFLAGS)" -o bin/router ./cmd/router

# The release image (docs/release.md): linux/amd64 and linux/arm64, FROM
# scratch, user 65532, as an OCI image layout in bin/image, the binaries
# in bin/router-linux-*. Needs only Go; reproducible.
image:
	go run ./internal/ociimage -version $(VERSION) -commit "$(COMMIT)" -epoch $(SOURCE_DATE_EPOCH) -out bin/image -bin bin

# Push bin/image (make image first) as $(IMAGE):$(VERSION); crane reads
# the credentials of docker login or crane auth login.
push:
	$(CRANE) push bin/image $(IMAGE):$(VERSION)

test:
	go test -race ./...

bench:
	go test -run '^$$' -bench . -benchtime 200x ./routing ./router ./cachemodel ./blockhash

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
