package main

import (
	"context"
	"fmt"
	"net/url"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/semroute/semroute/configs"
)

// newTracer returns a tracer exporting over OTLP/HTTP to the configured
// collector, and the function that flushes and stops it; nil and a no-op
// when tracing is off.
func newTracer(c configs.TracingConfig) (trace.Tracer, func(context.Context) error, error) {
	if c.OTLPEndpoint == "" {
		return nil, func(context.Context) error { return nil }, nil
	}
	u, err := url.Parse(c.OTLPEndpoint)
	if err != nil {
		return nil, nil, fmt.Errorf("config: tracing.otlp_endpoint: %w", err)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u.String()))
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: %w", err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(c.SampleRatio))),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", c.ServiceName))),
	)
	return tp.Tracer("github.com/semroute/semroute"), tp.Shutdown, nil
}
