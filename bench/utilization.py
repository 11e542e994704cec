"""Cost of one utilization sample (`UtilizationSampler.sample`) on a simulated 8-GPU node.

Scenarios on the simulated ``hgx-h100`` (8 H100s):

* ``whole``: 8 claims of one whole GPU each, every GPU busy (3 processes each);
* ``shares``: 4 GPUs with 4 MPS shares each (16 claims), 4 processes per share, each mapped to
  its pod through a cgroup file (under a scratch ``/proc``);
* ``whole+collect``: ``whole`` plus one scrape of the per-claim collector (what Prometheus adds).

Simulated NVML costs far less than libnvidia-ml (microseconds per call, against tens to
hundreds): the numbers are the plugin's own cost per sample; the NVML calls per sample are
counted so that real costs can be estimated. ``python -m bench.utilization [--samples 200]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, SimulatedProcess
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, PodRef
from gpu_dra.kubelet_plugin.utilization.metrics import ClaimUtilizationCollector
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler

GIB = 2**30


class CountingNvml:
    """Counts the calls made through it."""

    def __init__(self, nvml: SimulatedNvml) -> None:
        self.nvml = nvml
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        found = getattr(self.nvml, name)
        if not callable(found):
            return found

        def counted(*args: object) -> object:
            self.calls += 1
            return found(*args)

        return counted


def _pod_uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012x}"


def whole(nvml: SimulatedNvml, proc: Path) -> list[ClaimDevice]:
    devices = []
    for gpu in nvml.profile.gpus:
        procs = tuple(SimulatedProcess(10_000 + gpu.index * 10 + i, GIB, 30) for i in range(3))
        nvml.set_activity(gpu.index, DeviceActivity(90, 40, processes=procs))
        claim = ClaimRef("bench", f"uid-{gpu.index}", f"claim-{gpu.index}")
        pods = (PodRef(_pod_uid(gpu.index), f"pod-{gpu.index}"),)
        devices.append(ClaimDevice(claim, f"gpu-{gpu.minor}", "gpu", gpu.uuid, pods))
    return devices


def shares(nvml: SimulatedNvml, proc: Path) -> list[ClaimDevice]:
    devices = []
    for gpu in nvml.profile.gpus[:4]:
        procs = []
        for share in range(4):
            n = gpu.index * 4 + share
            claim = ClaimRef("bench", f"uid-{n}", f"share-{n}")
            pods = (PodRef(_pod_uid(n), f"pod-{n}"),)
            devices.append(
                ClaimDevice(claim, f"gpu-{gpu.minor}", "mps-share", gpu.uuid, pods, 10 * GIB, 25)
            )
            for i in range(4):
                pid = 20_000 + n * 10 + i
                (proc / str(pid)).mkdir(parents=True, exist_ok=True)
                cgroup = f"0::/kubepods/burstable/pod{_pod_uid(n)}/c{i}\n"
                (proc / str(pid) / "cgroup").write_text(cgroup)
                procs.append(SimulatedProcess(pid, GIB, 5))
        nvml.set_activity(gpu.index, DeviceActivity(80, 30, processes=tuple(procs)))
    return devices


def measure(name: str, samples: int, collect: bool = False) -> None:
    nvml = SimulatedHost.load("hgx-h100", "bench").nvml
    counting = CountingNvml(nvml)
    with tempfile.TemporaryDirectory() as scratch:
        proc = Path(scratch)
        devices = (shares if name == "shares" else whole)(nvml, proc)
        sampler = UtilizationSampler(counting, proc_root=proc)  # type: ignore[arg-type]
        monitor = UtilizationMonitor(
            sampler, lambda: devices, interval_s=10, idle_threshold_percent=5
        )
        collector = ClaimUtilizationCollector("bench", lambda: devices, monitor)
        monitor.sample_once()  # NVML init
        counting.calls = 0
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            monitor.sample_once()
            if collect:
                for _family in collector.collect():
                    pass
            times.append(time.perf_counter() - started)
        sampler.close()
    times.sort()
    label = f"{name}+collect" if collect else name
    print(
        f"{label:14} claims {len(devices):2}  NVML calls/sample {counting.calls / samples:5.1f}  "
        f"mean {statistics.mean(times) * 1e3:6.3f} ms  p50 {times[len(times) // 2] * 1e3:6.3f} ms"
        f"  p99 {times[int(len(times) * 0.99) - 1] * 1e3:6.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    measure("whole", args.samples)
    measure("shares", args.samples)
    measure("whole", args.samples, collect=True)


if __name__ == "__main__":
    main()
