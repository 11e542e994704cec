"""MIG as the e2e tests see it with ``--dynamic-mig``: the simulated GPUs keep their MIG state in
the plugin's ``simulated-nvml.json``, which these helpers read as the "hardware"."""

from __future__ import annotations

import json
from typing import Any

from e2e import manifests as m
from e2e.driver import Driver
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE

MIG_CLASS = "mig.nvidia.com"


def gpu_states(driver: Driver) -> dict[str, dict[str, Any]]:
    """MIG state of every simulated GPU, by UUID (the plugin's simulated-nvml.json)."""
    path = driver.state_dir / SIMULATED_STATE_FILE
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text())["gpus"])


def mig_instances(driver: Driver) -> dict[str, list[dict[str, Any]]]:
    return {u: s["gpuInstances"] for u, s in gpu_states(driver).items() if s["gpuInstances"]}


def mig_modes(driver: Driver) -> dict[str, list[int]]:
    return {u: [s["current"], s["pending"]] for u, s in gpu_states(driver).items()}


def mig_request(name: str, profile: str, *selectors: str) -> m.Obj:
    return m.request(
        name,
        MIG_CLASS,
        selectors=[f"device.attributes['gpu.nvidia.com'].profile == '{profile}'", *selectors],
    )


def reset_simulated_gpus(driver: Driver) -> None:
    """Every simulated GPU as a reboot leaves it (`SimulatedNvml.reset_gpu`): its MIG instances
    gone, its pending MIG mode current. Only while the plugin is stopped: it keeps the state in
    memory too and writes it back."""
    path = driver.state_dir / SIMULATED_STATE_FILE
    saved = json.loads(path.read_text())
    for gpu in saved["gpus"].values():
        gpu["gpuInstances"] = []
        gpu["current"] = gpu["pending"]
    staged = path.with_name(f".{path.name}.e2e-reset")
    staged.write_text(json.dumps(saved))
    staged.replace(path)
