//go:build tools

// Package tools pins the Kubernetes components the e2e cluster runs. The binaries are
// built from these packages by e2e/cluster (see docs/e2e-cluster.md); nothing here is
// compiled into gpu-dra itself.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
	_ "k8s.io/kubectl/pkg/cmd"
)
