"""Right-sizing advice (pure): given what one claim device used at most over a window (memory,
GPU utilization, processes) on a GPU model, the smallest tier of the catalog that would have held
it with headroom, and a ResourceClaimTemplate asking for it. The rule, the headroom and the
limits: docs/metrics.md#right-sizing.

Needs: memory = peak * (1 + headroom); compute = peak GPU utilization (a MIG device's: of its
own SMs, scaled to the GPU) * (1 + headroom), or, where no utilization was observed (MIG devices
without GPM), what the claim holds now. Options, at
most one of each kind: the smallest MIG profile of the model holding both (its compute: its
multiprocessors in percent of the model's largest profile's), an MPS share (memory rounded up to
a whole GiB, compute to a step of 5 %) when it is at most half the GPU, and the whole GPU (when
it holds the peak). The recommendation is the smallest option offered, by the larger of its
memory and compute fractions of the GPU; ties go to the whole GPU, then MIG.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.nvml.simulated_profiles import builtin_models

GIB: Final = 2**30
DEFAULT_HEADROOM_PERCENT: Final = 10.0
COMPUTE_STEP_PERCENT: Final = 5
SHARE_AT_MOST: Final = 0.5
"""An MPS share is proposed up to this fraction of the GPU (memory and compute)."""
MIG_CLASSES: Final = {1: "mig-1g", 2: "mig-2g", 3: "mig-3g", 4: "mig-4g", 7: "mig-7g"}
Kind = Literal["gpu", "mig", "mps-share"]
_KIND_ORDER: Final[dict[str, int]] = {"gpu": 0, "mig": 1, "mps-share": 2}


@dataclass(frozen=True)
class MigSize:
    """One MIG profile of a GPU model (``+me`` variants left out: same size, one per GPU)."""

    name: str
    memory_bytes: int
    compute_slices: int
    compute_percent: float
    """Its multiprocessors in percent of the model's largest profile's (A100 ``1g``: 14 of 98,
    14.3 %; H100 ``1g.10gb``: 16 of 132, 12.1 %)."""


@dataclass(frozen=True)
class GpuShape:
    """What the advice needs of a GPU model."""

    product: str
    """``productName`` as published (``NVIDIA A100-SXM4-80GB``)."""
    memory_bytes: int
    mig: tuple[MigSize, ...] = ()


def gpu_shape(product: str, memory_bytes: int | None = None) -> GpuShape | None:
    """The shape of a product gpu-dra knows (``gpu_models.json``); for another product, a shape
    without MIG profiles when its memory is known, else None."""
    for model in builtin_models().values():
        if model.name != product or model.memory_total_mib is None:
            continue
        profiles = model.mig.profiles if model.mig else ()
        most = max((p.multiprocessors for p in profiles), default=0)
        sizes = tuple(
            MigSize(p.name, p.memory_mib * 2**20, p.slice_count, 100 * p.multiprocessors / most)
            for p in profiles
            if "+" not in p.name
        )
        return GpuShape(product, model.memory_total_mib * 2**20, sizes)
    return None if memory_bytes is None else GpuShape(product, memory_bytes)


@dataclass(frozen=True)
class Observed:
    """The peaks of one claim device over the window (None: never read)."""

    memory_used_bytes: float | None
    gpu_percent: float | None
    processes: float | None = None


@dataclass(frozen=True)
class Held:
    """What the claim device holds now."""

    tier: str
    """As the plugin's metrics label it: ``gpu``, ``mig``, ``mps``, ``mps-share``,
    ``timeslicing``."""
    compute_percent: float = 100.0
    """Of the GPU: 100 for a whole GPU, a MIG slice's share, an MPS share's compute. A MIG
    device's utilization is of its own SMs: scaled by this."""
    profile: str | None = None


@dataclass(frozen=True)
class Option:
    kind: Kind
    device_class: str
    memory_bytes: int
    compute_percent: float
    size: float
    """The larger of its memory and compute fractions of the GPU (0-1)."""
    profile: str | None = None

    @property
    def key(self) -> str:
        """``gpu``, ``mps-share`` or ``mig:<profile>``."""
        return f"mig:{self.profile}" if self.kind == "mig" else self.kind

    def text(self) -> str:
        """``a 1g.10gb MIG slice``, ``a 7Gi / 15 % MPS share``, ``the whole GPU``."""
        if self.kind == "mig":
            return f"a {self.profile} MIG slice"
        if self.kind == "mps-share":
            return f"a {self.memory_bytes // GIB}Gi / {self.compute_percent:g} % MPS share"
        return "the whole GPU"


@dataclass(frozen=True)
class Advice:
    need_memory_bytes: float | None
    need_compute_percent: float | None
    compute_observed: bool
    options: tuple[Option, ...]
    """What holds the need, smallest first."""
    unused: bool
    notes: tuple[str, ...]

    def recommended(self, offered: Collection[str] | None = None) -> Option | None:
        """The smallest option whose `Option.key` is `offered` (None: all are); the smallest of
        all when none is offered."""
        if offered is not None:
            for option in self.options:
                if option.key in offered:
                    return option
        return self.options[0] if self.options else None


def advise(
    shape: GpuShape,
    observed: Observed,
    held: Held,
    *,
    headroom_percent: float = DEFAULT_HEADROOM_PERCENT,
) -> Advice:
    """The options holding `observed` with `headroom_percent` on `shape` (module docstring)."""
    notes: list[str] = []
    factor = 1 + headroom_percent / 100
    unused = observed.processes == 0 or observed.gpu_percent == 0
    if observed.memory_used_bytes is None:
        notes.append("its memory use was never read: no advice")
        return Advice(None, None, False, (), unused, tuple(notes))
    need_memory = observed.memory_used_bytes * factor
    observed_compute = observed.gpu_percent is not None
    on_mig = held.tier == "mig"
    if observed.gpu_percent is not None:
        gpu_percent = observed.gpu_percent
        if on_mig:
            gpu_percent = observed.gpu_percent * held.compute_percent / 100
            notes.append(
                f"a MIG device's SM utilization (GPM) is of its own SMs: {observed.gpu_percent:.3g}"
                f" % of its slice is {gpu_percent:.3g} % of the GPU"
            )
        need_compute = min(gpu_percent * factor, 100.0)
        if held.tier == "timeslicing":
            notes.append(
                "time-sliced: the utilization is the GPU's, all its claims together (an upper "
                "bound for this one)"
            )
    else:
        need_compute = held.compute_percent
        why = (
            "NVML reports no SM utilization on this MIG device (no GPM: A100 and older)"
            if on_mig or held.profile
            else "its utilization was never read"
        )
        notes.append(f"{why}: compute kept at what it holds now ({held.compute_percent:.3g} %)")
    options: list[Option] = []
    mig = _smallest_mig(shape, need_memory, need_compute)
    if mig is not None:
        options.append(mig)
    share = _share(shape, need_memory, need_compute)
    if share is not None:
        options.append(share)
    if observed.memory_used_bytes <= shape.memory_bytes:
        options.append(Option("gpu", "gpu.nvidia.com", shape.memory_bytes, 100.0, 1.0))
        if need_memory > shape.memory_bytes:
            notes.append(f"less than {headroom_percent:g} % memory headroom even on the whole GPU")
    else:
        notes.append("its peak memory is more than the GPU has: no advice")
    options.sort(key=lambda o: (o.size, _KIND_ORDER[o.kind]))
    if unused:
        notes.append(
            "no compute process, or no SM activity, in any sample of the window: the claim is "
            "unused; delete it (or its pods) rather than shrink it"
        )
    return Advice(need_memory, need_compute, observed_compute, tuple(options), unused, tuple(notes))


def _smallest_mig(shape: GpuShape, need_memory: float, need_compute: float) -> Option | None:
    fitting = [
        Option(
            "mig",
            f"{MIG_CLASSES.get(m.compute_slices, 'mig')}.gpu.nvidia.com"
            if m.compute_slices in MIG_CLASSES
            else "mig.nvidia.com",
            m.memory_bytes,
            m.compute_percent,
            max(m.memory_bytes / shape.memory_bytes, m.compute_percent / 100),
            m.name,
        )
        for m in shape.mig
        if m.memory_bytes >= need_memory and m.compute_percent >= need_compute
    ]
    return min(fitting, key=lambda o: (o.size, o.memory_bytes), default=None)


def _share(shape: GpuShape, need_memory: float, need_compute: float) -> Option | None:
    memory = max(math.ceil(need_memory / GIB), 1) * GIB
    step = COMPUTE_STEP_PERCENT
    compute = min(max(math.ceil(need_compute / step) * step, step), 100)
    if memory > shape.memory_bytes * SHARE_AT_MOST or compute > 100 * SHARE_AT_MOST:
        return None
    size = max(memory / shape.memory_bytes, compute / 100)
    return Option("mps-share", "mps.gpu.nvidia.com", memory, float(compute), size)


@dataclass(frozen=True)
class TemplateRequest:
    name: str
    option: Option
    product: str
    count: int = 1


def claim_template(
    namespace: str,
    name: str,
    requests: Sequence[TemplateRequest],
    *,
    driver: str = DEFAULT_DRIVER_NAME,
) -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` ResourceClaimTemplate with one request per entry: the option's
    class, pinned to the product it was measured on; an MPS share names both amounts."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [_request(r, driver) for r in requests]}}},
    }


def _request(request: TemplateRequest, driver: str) -> dict[str, Any]:
    option = request.option
    attributes = f"device.attributes['{driver}']"
    product = request.product.replace("\\", "\\\\").replace("'", "\\'")
    expression = f"{attributes}.productName == '{product}'"
    if option.kind == "mig":
        expression = f"{attributes}.profile == '{option.profile}' && {expression}"
    exactly: dict[str, Any] = {
        "deviceClassName": option.device_class,
        "selectors": [{"cel": {"expression": expression}}],
    }
    if request.count > 1:
        exactly["count"] = request.count
    if option.kind == "mps-share":
        exactly["capacity"] = {
            "requests": {
                "memory": f"{option.memory_bytes // GIB}Gi",
                "compute": f"{option.compute_percent:g}",
            }
        }
    return {"name": request.name, "exactly": exactly}


def offered_options(devices: Sequence[Mapping[str, Any]], product: str, driver: str) -> set[str]:
    """`Option.key`s that `devices` (ResourceSlice devices of `driver`'s pools) offer for
    `product`: ``gpu`` (whole GPUs), ``mig:<profile>`` (MIG devices and dynamic MIG partitions),
    ``mps-share`` (GPUs offered as MPS shares: a ``compute`` capacity, several claims, no
    ``cappedShares``). A device offered as shares is share-only: not a whole GPU or MIG device
    (the whole-device classes test for ``compute``)."""
    offered = set()
    for device in devices:
        attributes = device.get("attributes") or {}
        if _string(attributes, "productName", driver) != product:
            continue
        kind = _string(attributes, "type", driver)
        capacity = device.get("capacity") or {}
        shares = "compute" in capacity or f"{driver}/compute" in capacity
        if shares:
            multiple = device.get("allowMultipleAllocations") is True
            if kind == "gpu" and multiple and not _has(attributes, "cappedShares", driver):
                offered.add("mps-share")
        elif kind == "gpu":
            offered.add("gpu")
        elif kind == "mig":
            profile = _string(attributes, "profile", driver)
            if profile:
                offered.add(f"mig:{profile}")
    return offered


def _string(attributes: Mapping[str, Any], key: str, driver: str) -> str | None:
    value = attributes.get(key, attributes.get(f"{driver}/{key}"))
    found = value.get("string") if isinstance(value, Mapping) else None
    return found if isinstance(found, str) else None


def _has(attributes: Mapping[str, Any], key: str, driver: str) -> bool:
    return key in attributes or f"{driver}/{key}" in attributes
