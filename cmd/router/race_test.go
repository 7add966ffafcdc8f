//go:build race

package main

// raceOn is set when the race detector is: the replay tables of the README
// and docs/, deterministic single-goroutine replays it finds nothing in and
// slows ten times, are then checked in part (TestReadmeReplayTables...).
const raceOn = true
