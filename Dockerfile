# syntax=docker/dockerfile:1
# The release image for people with Docker: the same files and settings as
# `make image` (internal/ociimage, docs/release.md): FROM scratch, nonroot
# 65532 in /etc/passwd and /etc/group, /tmp, the static router at /router,
# Mozilla's roots inside the binary. Multi-arch, cross-compiled on the
# builder's platform:
#   docker buildx build --platform linux/amd64,linux/arm64 -t semroute:dev \
#     --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg COMMIT=$(git rev-parse HEAD) .
# Its digest is Docker's to decide; `make image` is the reproducible build.
FROM --platform=$BUILDPLATFORM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG TARGETOS TARGETARCH VERSION=dev COMMIT=
RUN CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH GOAMD64=v1 GOARM64=v8.0 \
    go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X main.version=${VERSION} -X main.commitFlag=${COMMIT}" \
    -o /out/router ./cmd/router \
 && mkdir -p /rootfs/etc /rootfs/tmp \
 && cp internal/ociimage/rootfs/etc/passwd internal/ociimage/rootfs/etc/group /rootfs/etc/ \
 && chmod 0755 /rootfs/etc && chmod 0644 /rootfs/etc/passwd /rootfs/etc/group \
 && chmod 1777 /rootfs/tmp

FROM scratch
COPY --from=build /rootfs/ /
COPY --from=build /out/router /router
USER 65532:65532
EXPOSE 8080 9090 9091
ENTRYPOINT ["/router"]
CMD ["serve", "--config", "/etc/semroute/router.yaml"]
ARG VERSION=dev COMMIT=
LABEL org.opencontainers.image.title="semroute" \
      org.opencontainers.image.description="KV-cache-aware router for OpenAI-compatible inference replicas" \
      org.opencontainers.image.source="https://github.com/semroute/semroute" \
      org.opencontainers.image.url="https://github.com/semroute/semroute" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}"
