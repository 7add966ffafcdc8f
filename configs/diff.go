package configs

import (
	"reflect"
	"strings"
)

// Diff returns the keys whose values differ between a and b, as dotted
// paths of the config's field names ("limits.max_body_bytes"), in the
// order the fields are declared. A list or map (replicas, routing.arms,
// routing.kind_weights) is one key.
func Diff(a, b *Config) []string {
	var out []string
	diff(reflect.ValueOf(*a), reflect.ValueOf(*b), "", &out)
	return out
}

func diff(a, b reflect.Value, prefix string, out *[]string) {
	t := a.Type()
	for i := range t.NumField() {
		key, _, _ := strings.Cut(t.Field(i).Tag.Get("mapstructure"), ",")
		if key == "" || key == "-" {
			continue
		}
		key = prefix + key
		fa, fb := a.Field(i), b.Field(i)
		if fa.Kind() == reflect.Struct {
			diff(fa, fb, key+".", out)
			continue
		}
		if !reflect.DeepEqual(fa.Interface(), fb.Interface()) {
			*out = append(*out, key)
		}
	}
}
