"""Host hardware edge: the NVML seam (`interface`), its pynvml and simulated backends, sysfs PCI."""
