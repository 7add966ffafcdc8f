//go:build race

package main

// raceOn is set when the race detector is: the README's replay tables,
// deterministic single-goroutine replays it finds nothing in and slows
// ten times, are then checked in part (TestReadmeReplayTables...).
const raceOn = true
