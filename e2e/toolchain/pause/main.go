// Command pause is the sandbox ("pause") process of the e2e cluster's pods: it holds the pod's
// namespaces open, reaps orphaned children and exits on SIGINT/SIGTERM. Built statically and
// packed into a local OCI image by e2e/cluster/images.py.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
