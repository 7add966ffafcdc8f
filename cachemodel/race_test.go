//go:build race

package cachemodel

// raceSteps divides the steps of the single-goroutine property tests when
// the race detector is on: it finds nothing in them (TestConcurrentUse is
// the one that shares the model across goroutines, and runs whole) and
// makes them ten times slower; without -race they run in full.
const raceSteps = 4
