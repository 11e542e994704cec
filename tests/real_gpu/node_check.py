"""The plugin's real paths on a real GPU node, against the simulator and NVIDIA's own tools.

``python -m tests.real_gpu.node_check <out dir> [<nvidia-ctk dir>]`` writes ``node.json``,
``cdi-gpu-dra.json`` and ``cdi-nvidia-ctk.yaml`` into <out dir>:

- the driver root found (the first of ``/``, ``/usr/local/nvidia``, ``/run/nvidia/driver``
  where `find_nvml_library` finds NVML);
- what real mode publishes (`tests.e2e_tools.plugin_probe`) vs the simulator on a profile of
  the same GPUs (same model, bus ids, NUMA nodes, PCIe roots, MIG state), field by field;
- ``gpu-dra devices --driver-root``;
- the plugin's CDI spec for each published device (`tests.e2e_tools.plugin_cdi_probe`) vs
  ``nvidia-ctk cdi generate`` on the same root, classified by the comparison of
  `tests.e2e_tools.test_cdi_vs_nvidia_ctk`; every host path of the spec checked;
- ``nvidia-smi -L`` in a chroot made of the spec's mounts and device nodes (plus the host's
  glibc and /proc), as a container of the claim would run it;
- the cgroup memory-limit calls; the utilization sampler under load, and its cost per pass.
Nothing here changes MIG or compute mode.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpu_dra.driver.nvml.real import RealNvml, find_nvml_library
from gpu_dra.driver.nvml.simulated_profiles import builtin_models
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory, node_nvml
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from tests.e2e_tools import published_diff
from tests.e2e_tools import test_cdi_vs_nvidia_ctk as cdi_vs_ctk
from tests.e2e_tools.plugin_probe import publication

REAL_NODE_EXPLAINED = {
    # docs/real-nodes.md, "On a real GPU": differences seen only on real nodes
    "no graphics configuration (Vulkan ICD, EGL vendor files)": lambda d: (
        d.only == "nvidia-ctk" and d.item.aspect == "mount" and d.item.key in GRAPHICS_CONFIG
    ),
    "device nodes from /dev when the driver root's /dev has no nvidiactl": lambda d: (
        d.only == "gpu-dra" and d.item.aspect == "device node" and d.item.value.startswith("/dev/")
    ),
}
GRAPHICS_CONFIG = (
    "/etc/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
)

ROOTS = (Path("/"), Path("/usr/local/nvidia"), Path("/run/nvidia/driver"))
HOOK_PATH = "/usr/bin/nvidia-cdi-hook"


def step(report: dict[str, Any], name: str, action: Callable[[], Any]) -> Any:
    started = time.monotonic()
    try:
        result = action()
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    report[name] = result
    print(f"node_check: {name} ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
    return result


def run(command: list[str], timeout: float = 120, **kwargs: Any) -> dict[str, Any]:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:]}


def last_json(result: dict[str, Any]) -> Any:
    lines = result["stdout"].strip().splitlines()
    if result["rc"] != 0 or not lines:
        raise RuntimeError(f"rc {result['rc']}: {result['stderr'][-1500:]}")
    return json.loads(lines[-1])


def driver_root() -> dict[str, Any]:
    override = os.environ.get("GPU_DRA_REAL_GPU_ROOT")
    for root in (Path(override),) if override else ROOTS:
        library = find_nvml_library(root)
        if library is not None:
            return {"root": str(root), "library": str(library)}
    raise RuntimeError(f"no libnvidia-ml under {', '.join(map(str, ROOTS))}")


def gpu_facts(root: Path) -> dict[str, Any]:
    nvml = RealNvml(root)
    nvml.init()
    try:
        facts: dict[str, Any] = {
            "driverVersion": nvml.system_get_driver_version(),
            "cudaDriverVersion": nvml.system_get_cuda_driver_version(),
            "gpus": [],
        }
        for index in range(nvml.device_get_count()):
            handle = nvml.device_get_handle_by_index(index)
            gpu: dict[str, Any] = {
                "name": nvml.device_get_name(handle),
                "uuid": nvml.device_get_uuid(handle),
                "busId": nvml.device_get_pci_info(handle).busId,
                "memory": nvml.device_get_memory_info(handle).total,
                "computeMode": nvml.device_get_compute_mode(handle),
            }
            try:
                gpu["migMode"] = nvml.device_get_mig_mode(handle)
            except Exception as error:
                gpu["migMode"] = f"{type(error).__name__}: {error}"
            try:
                limits = nvml.device_get_memory_limits(handle, "/")
                gpu["memoryLimits('/')"] = repr(limits)
            except Exception as error:
                gpu["memoryLimits('/')"] = f"{type(error).__name__}: {error}"
            facts["gpus"].append(gpu)
        return facts
    finally:
        nvml.shutdown()


def mig_profiles(root: Path) -> list[dict[str, Any]]:
    """Every GPU-instance profile GPU 0's driver answers (version 3 info: with its name), with
    its placements: the real table the simulator's model must match."""
    nvml = RealNvml(root)
    nvml.init()
    try:
        handle = nvml.device_get_handle_by_index(0)
        table = []
        for profile in range(16):
            try:
                info = nvml.device_get_gpu_instance_profile_info(handle, profile, 3)
            except Exception:
                try:
                    info = nvml.device_get_gpu_instance_profile_info(handle, profile, 2)
                except Exception as error:
                    table.append({"profile": profile, "error": f"{type(error).__name__}: {error}"})
                    continue
            fields = {
                name: getattr(info, name)
                for name, _ in info._fields_
                if name not in ("version", "capabilities")
            }
            fields = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in fields.items()}
            try:
                placements = nvml.device_get_gpu_instance_possible_placements(handle, info.id)
                fields["placements"] = [(p.start, p.size) for p in placements]
            except Exception as error:
                fields["placements"] = f"{type(error).__name__}: {error}"
            table.append({"profile": profile, **fields})
        return table
    finally:
        nvml.shutdown()


def memory_limit_symbols(library: str) -> dict[str, bool]:
    lib = ctypes.CDLL(library)
    names = ("nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1")
    return {name: hasattr(lib, name) for name in names}


def cgroups() -> dict[str, Any]:
    root = Path("/sys/fs/cgroup")
    found: dict[str, Any] = {"fs": run(["stat", "-fc", "%T", str(root)])["stdout"].strip()}
    controllers = root / "cgroup.controllers"
    found["controllers"] = controllers.read_text().split() if controllers.exists() else None
    found["dmem files"] = sorted(p.name for p in root.glob("dmem.*"))
    found["self"] = Path("/proc/self/cgroup").read_text().strip()
    return found


def model_key(name: str) -> str:
    for key, model in builtin_models().items():
        if model.name == name:
            return key
    raise RuntimeError(f"no simulated model named {name!r}")


def topology(bus_id: str) -> tuple[int | None, str | None]:
    short = bus_id.lower()[4:] if len(bus_id) == 16 else bus_id.lower()
    device = Path("/sys/bus/pci/devices") / short
    if not device.exists():
        return None, None
    numa = int((device / "numa_node").read_text().strip())
    parts = device.resolve().parts
    root = parts[3] if len(parts) > 3 and parts[3].startswith("pci") else None
    return (None if numa < 0 else numa), root


def simulated_profile(facts: dict[str, Any], real: dict[str, Any], path: Path) -> Path:
    version = facts["driverVersion"]
    gpus = []
    for gpu in facts["gpus"]:
        numa, pcie_root = topology(gpu["busId"])
        entry: dict[str, Any] = {"busId": gpu["busId"], "model": model_key(gpu["name"])}
        if numa is not None:
            entry["numaNode"] = numa
        if pcie_root is not None:
            entry["pcieRoot"] = pcie_root
        mode = gpu.get("migMode")
        if isinstance(mode, list) and mode[0] == 1:
            entry["migMode"] = mode
            entry["migDevices"] = [
                {"profileId": m["giProfileId"], "start": m["placement"][0]}
                for m in real["migDevices"]
                if m["parent"] == gpu["uuid"]
            ]
        gpus.append(entry)
    document = {
        "name": "real-gpu-node",
        "description": "the lent machine's GPUs, for the comparison",
        "driverVersion": version,
        "cudaDriverVersion": facts["cudaDriverVersion"],
        "gpus": gpus,
    }
    path.write_text(yaml.safe_dump(document))
    return path


def simulated_publication(spec: Path, work: Path, dynamic_mig: bool) -> dict[str, Any]:
    flags = ["--node-name=node-a", f"--simulate={spec}", f"--data-dir={work / 'sim-data'}"]
    settings = KubeletPluginSettings.parse(
        [*flags, *(["--dynamic-mig"] if dynamic_mig else [])], {}
    )
    nvml, pci = node_nvml(settings)
    devices = discover(settings, nvml, pci)
    return publication(devices, node_inventory(settings, devices))


def compare_publications(root: Path, facts: dict[str, Any], work: Path) -> dict[str, Any]:

    out: dict[str, Any] = {}
    for dynamic in (False, True):
        label = "dynamic MIG" if dynamic else "plain"
        flags = ["--dynamic-mig"] if dynamic else []
        probe = run(
            [sys.executable, "-m", "tests.e2e_tools.plugin_probe", str(root), "publish", *flags]
        )
        try:
            real = last_json(probe)
        except Exception as error:
            out[label] = {"real error": str(error)}
            continue
        spec = simulated_profile(facts, real, work / f"profile-{int(dynamic)}.yaml")
        simulated = simulated_publication(spec, work / f"sim-{int(dynamic)}", dynamic)
        found = published_diff.differences(real, simulated)
        out[label] = {
            "real devices": len(real["devices"]),
            "simulated devices": len(simulated["devices"]),
            "real problems": real["problems"],
            "simulated problems": simulated["problems"],
            "real migDevices": real["migDevices"],
            "differences": [str(d) for d in found],
            "real": real,
        }
    return out


def cdi(root: Path, ctk_dir: Path | None, work: Path, out_dir: Path) -> dict[str, Any]:

    result: dict[str, Any] = {}
    plugin_work = work / "cdi-plugin"
    plugin_work.mkdir()
    probe = run(
        [
            sys.executable,
            "-m",
            "tests.e2e_tools.plugin_cdi_probe",
            str(root),
            str(plugin_work),
            HOOK_PATH,
            "--any-node",
        ],
        timeout=240,
    )
    claims = last_json(probe)
    (out_dir / "cdi-gpu-dra.json").write_text(json.dumps(claims, indent=1))
    result["claims"] = [f"{c['label']} {c['device']} {c['sharing']}" for c in claims]
    result["missing host paths"] = sorted(  # an MPS claim's daemon dirs go at unprepare
        {
            path
            for claim in claims
            for path in host_paths(claim["spec"])
            if not os.path.lexists(path)
        }
    )
    if ctk_dir is None:
        result["nvidia-ctk"] = "not carried"
        return result
    generated = run(
        [
            str(ctk_dir / "nvidia-ctk"),
            "cdi",
            "generate",
            "--driver-root",
            str(root),
            "--nvidia-cdi-hook-path",
            HOOK_PATH,
            "--format",
            "yaml",
        ]
    )
    (out_dir / "cdi-nvidia-ctk.yaml").write_text(generated["stdout"])
    result["nvidia-ctk stderr"] = generated["stderr"][-2000:]
    if generated["rc"] != 0:
        result["nvidia-ctk rc"] = generated["rc"]
        return result
    ctk = yaml.safe_load(generated["stdout"])
    per_claim: dict[str, Any] = {}
    for claim in claims:
        if claim["sharing"] is not None:
            continue
        spec = claim["spec"]
        (device,) = spec["devices"]
        matches = [d for d in ctk["devices"] if d["name"] == claim["uuid"]]
        if not matches:
            per_claim[claim["label"]] = f"nvidia-ctk has no device {claim['uuid']}"
            continue
        theirs = cdi_vs_ctk.container_view(ctk["containerEdits"], matches[0]["containerEdits"])
        mine = cdi_vs_ctk.container_view(spec.get("containerEdits", {}), device["containerEdits"])
        found = cdi_vs_ctk.differences(claim["label"], theirs, mine)
        allowed: dict[str, int] = {}
        unexplained = []
        for difference in found:
            entry = next((a for a in cdi_vs_ctk.ALLOWED if a.matches(difference)), None)
            name = entry.name if entry is not None else None
            if name is None:
                real = [n for n, matches in REAL_NODE_EXPLAINED.items() if matches(difference)]
                name = real[0] if real else None
            if name is None:
                unexplained.append(str(difference))
            else:
                allowed[name] = allowed.get(name, 0) + 1
        per_claim[claim["label"]] = {"allowed": allowed, "unexplained": unexplained}
    result["comparison"] = per_claim
    return result


def host_paths(spec: dict[str, Any]) -> list[str]:
    paths = []
    for edits in [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]:
        paths += [m["hostPath"] for m in edits.get("mounts", [])]
        paths += [n.get("hostPath", n["path"]) for n in edits.get("deviceNodes", [])]
    return paths


def smi_in_spec_chroot(out_dir: Path, work: Path) -> dict[str, Any]:
    """``nvidia-smi -L`` in a root holding only the first whole-GPU claim's spec mounts and
    device nodes, the host's glibc and /proc: the driver userspace a container gets."""
    claims = json.loads((out_dir / "cdi-gpu-dra.json").read_text())
    claim = next(
        c for c in claims if c["sharing"] is None and re.fullmatch(r"gpu-\d+", c["device"])
    )
    spec = claim["spec"]
    edits = [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
    mounts = [m for e in edits for m in e.get("mounts", [])]
    nodes = [n for e in edits for n in e.get("deviceNodes", [])]
    smi = next(m for m in mounts if m["containerPath"].endswith("/nvidia-smi"))
    library_dirs = sorted(
        {str(Path(m["containerPath"]).parent) for m in mounts if ".so" in m["containerPath"]}
    )
    rootfs = work / "rootfs"
    rootfs.mkdir()
    lines = ["set -e"]
    for path in glibc(smi["hostPath"]):
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for mount in mounts:
        target = rootfs / mount["containerPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(mount["hostPath"]).is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.touch()
        lines.append(f"mount --bind {shlex.quote(mount['hostPath'])} {shlex.quote(str(target))}")
    for node in nodes:
        target = rootfs / node["path"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        host = node.get("hostPath", node["path"])
        lines.append(f"mount --bind {shlex.quote(host)} {shlex.quote(str(target))}")
    for directory in library_dirs:  # the soname links the update-ldcache hook makes
        lines.append(f"ldconfig -n {shlex.quote(str(rootfs / directory.lstrip('/')))}")
    (rootfs / "proc").mkdir()
    (rootfs / "tmp").mkdir()
    lines.append(f"mount -t proc proc {rootfs}/proc")
    env = " ".join(
        f"{k}={shlex.quote(v)}"
        for k, v in {"LD_LIBRARY_PATH": ":".join(library_dirs), "PATH": "/usr/bin:/bin"}.items()
    )
    lines.append(f"exec chroot {rootfs} /usr/bin/env -i {env} {smi['containerPath']} -L")
    # /usr/bin/env from the host
    (rootfs / "usr/bin").mkdir(parents=True, exist_ok=True)
    for path in glibc("/usr/bin/env"):
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(path, target)
    shutil.copy2("/usr/bin/env", rootfs / "usr/bin/env")
    result = run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines)], timeout=60
    )
    host = run([smi["hostPath"], "-L"])
    resolved = os.path.realpath(smi["hostPath"])
    return {
        "nvidia-smi host path": f"{smi['hostPath']} -> {resolved}",
        "interpreter": interpreter(resolved),
        "glibc copied": glibc(smi["hostPath"]),
        "claim": claim["label"],
        "mounts": len(mounts),
        "device nodes": [n["path"] for n in nodes],
        "LD_LIBRARY_PATH": library_dirs,
        "in chroot": result,
        "on the host": host,
    }


GLIBC = re.compile(r"(ld-linux[^/]*\.so\.\d|lib(c|m|dl|pthread|rt|gcc_s)\.so\.\d+)$")


def glibc(binary: str) -> list[str]:
    """The C library files `binary` links (ldd), the ELF interpreter included, wherever they
    live (a driver bundle may carry its own glibc); driver libraries excluded."""
    listed = run(["ldd", binary])["stdout"]
    found = []
    for line in listed.splitlines():
        match = re.search(r"(/\S+)", line)
        if match and GLIBC.search(match.group(1)):
            found.append(match.group(1))
    return found


def interpreter(binary: str) -> str:
    """The ELF program interpreter (PT_INTERP) of `binary`."""
    data = Path(binary).read_bytes()
    phoff = int.from_bytes(data[0x20:0x28], "little")
    size, count = (
        int.from_bytes(data[0x36:0x38], "little"),
        int.from_bytes(data[0x38:0x3A], "little"),
    )
    for index in range(count):
        header = data[phoff + index * size : phoff + (index + 1) * size]
        if int.from_bytes(header[0:4], "little") == 3:
            offset = int.from_bytes(header[8:16], "little")
            length = int.from_bytes(header[32:40], "little")
            return data[offset : offset + length].rstrip(b"\0").decode()
    return "(none)"


def utilization(root: Path) -> dict[str, Any]:
    """The sampler on GPU 0 while a CUDA process works on it, and its cost per pass."""
    load = (
        "import torch,time\n"
        "a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
        "end=time.time()+8\n"
        "while time.time()<end:\n a@a\n torch.cuda.synchronize()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    worker = subprocess.Popen(["python3", "-c", load], env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4)
        nvml = RealNvml(root)
        facts: dict[str, Any] = {}
        sampler = UtilizationSampler(nvml)
        try:
            nvml.init()
            uuid = nvml.device_get_uuid(nvml.device_get_handle_by_index(0))
            nvml.shutdown()
            claim = ClaimRef("default", "uid-1", "busy")
            for tier in ("gpu", "mps-share"):
                devices = [ClaimDevice(claim, "gpu-0", tier, uuid)]
                sampler.sample(devices)
                time.sleep(1)
                sample = sampler.sample(devices)
                facts[tier] = {
                    "reading": repr(sample.readings.get(uuid)),
                    "errors": [repr(e) for e in sample.errors],
                    "duration_ms": round(sample.duration_s * 1000, 2),
                }
            passes = [
                sampler.sample([ClaimDevice(claim, "gpu-0", "mps-share", uuid)]).duration_s
                for _ in range(50)
            ]
            facts["50 passes (mps-share tier), ms"] = {
                "median": round(sorted(passes)[25] * 1000, 2),
                "max": round(max(passes) * 1000, 2),
            }
        finally:
            sampler.close()
        facts["load pid"] = worker.pid
        return facts
    finally:
        worker.wait(timeout=30)
        facts_err = worker.stderr.read() if worker.stderr else ""
        if worker.returncode:
            print(f"load failed: {facts_err[-500:]}", file=sys.stderr)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    ctk_dir = Path(argv[1]) if len(argv) > 1 and argv[1] else None
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-real-"))
    found = step(report, "driver root", driver_root)
    if "error" in found:
        (out_dir / "node.json").write_text(json.dumps(report, indent=1))
        return 1
    root = Path(found["root"])
    step(report, "memory limit symbols", lambda: memory_limit_symbols(found["library"]))
    step(report, "cgroups", cgroups)
    step(report, "mig profiles", lambda: mig_profiles(root))
    facts = step(report, "gpus", lambda: gpu_facts(root))
    if "error" not in facts:
        step(report, "real vs simulated", lambda: compare_publications(root, facts, work))
    step(
        report,
        "gpu-dra devices",
        lambda: run([sys.executable, "-m", "gpu_dra.cli", "devices", "--driver-root", str(root)]),
    )
    step(report, "cdi", lambda: cdi(root, ctk_dir, work, out_dir))
    step(report, "nvidia-smi in the spec's root", lambda: smi_in_spec_chroot(out_dir, work))
    step(report, "utilization", lambda: utilization(root))
    (out_dir / "node.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
