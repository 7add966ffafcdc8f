// Package plugin is how config reaches a pluggable part (a routing policy,
// an eviction policy, a replica engine's reuse mode): a Spec names it by
// type, and its Params are decoded strictly into the plugin's own
// parameters struct, in the shape of the Gateway API Inference Extension's
// plugin configs ({type, parameters}). Each kind of part has one Registry,
// filled in one place by the package that defines the kind.
package plugin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"
)

// Spec names a plugin and its parameters: `{type: lru}`, or only the type
// where config gives a string.
type Spec struct {
	Type   string `json:"type" mapstructure:"type"`
	Params Params `json:"params,omitempty" mapstructure:"params"`
}

// Params are a plugin's parameters as config gives them: snake_case names
// to values (YAML or JSON). A nil Params means every default.
type Params map[string]any

// Decode fills into, a pointer to a struct whose fields carry json tags,
// from p: a name the struct does not have is an error naming the ones it
// has, as is a value of the wrong type. Fields p does not name keep their
// value (the plugin's defaults, set before the call).
func (p Params) Decode(into any) error {
	if len(p) == 0 {
		return nil
	}
	b, err := json.Marshal(map[string]any(p))
	if err != nil {
		return fmt.Errorf("params: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		names := Names(into)
		for k := range p {
			if !slices.Contains(names, k) {
				return fmt.Errorf("unknown parameter %q (have %s)", k, strings.Join(names, ", "))
			}
		}
		return fmt.Errorf("params: %w", err)
	}
	return nil
}

// DecodeOver decodes p over def, a plugin's parameters at their defaults,
// and checks the result with valid, if any.
func DecodeOver[T any](p Params, def T, valid func(*T) error) (T, error) {
	if err := p.Decode(&def); err != nil {
		return def, err
	}
	if valid != nil {
		if err := valid(&def); err != nil {
			return def, err
		}
	}
	return def, nil
}

// Names returns the parameter names of a params struct (or a pointer to
// one): its fields' json names. Nil for anything else.
func Names(params any) []string {
	t := reflect.TypeOf(params)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Kind() != reflect.Struct {
		return nil
	}
	var names []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "" && f.Anonymous: // an embedded struct's fields are its own, as encoding/json reads them
			names = append(names, Names(reflect.Zero(f.Type).Interface())...)
		case name != "" && name != "-":
			names = append(names, name)
		}
	}
	return names
}

// Duration is a time.Duration parameter: a Go duration string ("60s") or
// a number of seconds.
type Duration time.Duration

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err := time.ParseDuration(s)
		if err != nil {
			return err
		}
		*d = Duration(v)
		return nil
	}
	var secs float64
	if err := json.Unmarshal(b, &secs); err != nil {
		return fmt.Errorf("a duration is a string such as \"60s\" or a number of seconds, not %s", b)
	}
	*d = Duration(secs * float64(time.Second))
	return nil
}
