package plugin

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

type shapeParams struct {
	Sides int     `json:"sides"`
	Scale float64 `json:"scale"`
}

type shape struct {
	name string
	p    shapeParams
}

func shapes() *Registry[shape] {
	return NewRegistry("shape", "",
		Plugin[shape]{Name: "polygon", Aliases: []string{"poly"}, Params: shapeParams{},
			New: func(p Params) (shape, error) {
				c, err := DecodeOver(p, shapeParams{Sides: 3, Scale: 1}, func(c *shapeParams) error {
					if c.Sides < 3 {
						return errors.New("sides must be ≥ 3")
					}
					return nil
				})
				return shape{"polygon", c}, err
			}},
		Plugin[shape]{Name: "circle", New: func(Params) (shape, error) { return shape{name: "circle"}, nil }},
	)
}

// TestRegistry: a registry builds its plugins by name or alias, with their
// defaults and the parameters given; it refuses an unknown type naming the
// ones it has, a parameter the plugin does not have naming those it has,
// any parameter to a plugin that takes none, and passes on the plugin's
// own errors under its kind and name.
func TestRegistry(t *testing.T) {
	r := shapes()
	if got := r.Names(); !slices.Equal(got, []string{"polygon", "circle"}) {
		t.Errorf("names %v: the registration order, no aliases", got)
	}
	if s, err := r.New(Spec{Type: "poly", Params: Params{"sides": 5}}); err != nil || s != (shape{"polygon", shapeParams{Sides: 5, Scale: 1}}) {
		t.Errorf("the alias poly with sides 5: %+v, %v", s, err)
	}
	if s, err := r.New(Spec{Type: "circle"}); err != nil || s.name != "circle" {
		t.Errorf("circle: %+v, %v", s, err)
	}
	if p, ok := r.Lookup("poly"); !ok || p.Name != "polygon" {
		t.Errorf("Lookup of the alias: %+v, %v", p, ok)
	}
	for _, tc := range []struct {
		spec Spec
		want string
	}{
		{Spec{Type: "square"}, `unknown shape "square" (have polygon, circle)`},
		{Spec{Type: "polygon", Params: Params{"sides": 4, "colour": "red"}}, `shape polygon: unknown parameter "colour" (have sides, scale)`},
		{Spec{Type: "circle", Params: Params{"radius": 1}}, "shape circle takes no parameters"},
		{Spec{Type: "poly", Params: Params{"sides": 2}}, "shape polygon: sides must be ≥ 3"},
		{Spec{Type: "polygon", Params: Params{"sides": "many"}}, "shape polygon: params: "},
	} {
		_, err := r.New(tc.spec)
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %s", tc.spec, err, tc.want)
		}
	}
	nouned := NewRegistry("plane shape", "shape", Plugin[shape]{Name: "circle", New: func(Params) (shape, error) { return shape{}, nil }})
	if _, err := nouned.New(Spec{Type: "cube"}); err == nil || err.Error() != `unknown plane shape "cube" (have circle)` {
		t.Errorf("an unknown type names the kind: %v", err)
	}
	if _, err := nouned.New(Spec{Type: "circle", Params: Params{"r": 1}}); err == nil || err.Error() != "shape circle takes no parameters" {
		t.Errorf("a plugin's error names it by its noun: %v", err)
	}
}

// TestRegisterTwice: a name or alias registered twice, or an empty one,
// is a programming error.
func TestRegisterTwice(t *testing.T) {
	for _, p := range []Plugin[shape]{
		{Name: "circle"},
		{Name: "ring", Aliases: []string{"poly"}},
		{Name: ""},
	} {
		p.New = func(Params) (shape, error) { return shape{}, nil }
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%+v registered", p)
				}
			}()
			shapes().Register(p)
		}()
	}
	r := shapes()
	func() {
		defer func() { _ = recover() }()
		r.Register(Plugin[shape]{Name: "oval", Aliases: []string{"circle"}, New: func(Params) (shape, error) { return shape{}, nil }})
	}()
	if _, ok := r.Lookup("oval"); ok {
		t.Error("a refused registration left its name behind")
	}
}
