package configs

import "testing"

// TestRenamedKeysStillSet: a config written with a key's old name sets the
// key under its new one, and a value given under both names is the new
// name's.
func TestRenamedKeysStillSet(t *testing.T) {
	c, err := LoadBytes(NewViper(), []byte("grpc:\n  max_held_decisions: 7\n  max_held_blocks: 9\nreplicas: [{name: a, url: 'http://127.0.0.1:1'}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.GRPC.MaxUnreleasedDecisions != 7 || c.GRPC.MaxUnreleasedBlocks != 9 {
		t.Fatalf("old keys set %d and %d, want 7 and 9", c.GRPC.MaxUnreleasedDecisions, c.GRPC.MaxUnreleasedBlocks)
	}
	c, err = LoadBytes(NewViper(), []byte("grpc:\n  max_unreleased_decisions: 5\nreplicas: [{name: a, url: 'http://127.0.0.1:1'}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.GRPC.MaxUnreleasedDecisions != 5 {
		t.Fatalf("new key set %d, want 5", c.GRPC.MaxUnreleasedDecisions)
	}
}

// TestRenamedKeyLosesToItsNewName: with both names given, the new one's
// value stands.
func TestRenamedKeyLosesToItsNewName(t *testing.T) {
	c, err := LoadBytes(NewViper(), []byte("grpc:\n  max_held_decisions: 7\n  max_unreleased_decisions: 5\nreplicas: [{name: a, url: 'http://127.0.0.1:1'}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.GRPC.MaxUnreleasedDecisions != 5 {
		t.Fatalf("set %d, want the new name's 5", c.GRPC.MaxUnreleasedDecisions)
	}
}
