package main

import (
	"runtime"
	"syscall"
)

func maxRSSKiB() int64 {
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err != nil {
		return -1
	}
	return usage.Maxrss
}

func goVersion() string { return runtime.Version() }
