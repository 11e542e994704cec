"""Utilization per claim: NVML sampled in the background, mapped to the claims that hold each
device (MPS shares: to the processes' pods through their cgroups), exported as Prometheus
metrics. See docs/metrics.md."""
