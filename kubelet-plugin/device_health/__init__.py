"""Device health: the NVML / MPS health monitor, the kubelet's DRA health service, and the
simulated node's event inbox (docs/architecture.md, "Health monitor").

* :mod:`.monitor` - `HealthMonitor`: NVML events and the MPS daemon supervisor's verdicts
  (`gpu_dra.kubelet_plugin.mps.supervisor`) -> per-device health;
* :mod:`.service` - `DeviceHealthService`: ``NodeWatchResources`` (v1, v1alpha1) on the DRA
  socket;
* :mod:`.inbox` - `SimulatedEventInbox`: events for simulated GPUs, written by tests as files.
"""
