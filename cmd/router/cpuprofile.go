package main

import (
	"os"
	"runtime/pprof"
)

// startCPUProfile profiles this process's CPU into file until the returned
// stop (router serve --cpuprofile); with file "", it does nothing.
func startCPUProfile(file string) (stop func(), err error) {
	if file == "" {
		return func() {}, nil
	}
	f, err := os.Create(file)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
