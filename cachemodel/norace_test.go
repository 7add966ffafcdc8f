//go:build !race

package cachemodel

// raceSteps: see race_test.go.
const raceSteps = 1
