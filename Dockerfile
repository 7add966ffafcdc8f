# Multi-stage build of a static semroute binary.
#   docker build -t semroute:dev --build-arg VERSION=$(git describe --always) .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG COMMIT=unknown
RUN CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X main.version=${VERSION} -X main.commitFlag=${COMMIT}" \
    -o /out/router ./cmd/router

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/router /router
USER nonroot:nonroot
EXPOSE 8080 9090 9091
ENTRYPOINT ["/router"]
CMD ["serve", "--config", "/etc/semroute/router.yaml"]
