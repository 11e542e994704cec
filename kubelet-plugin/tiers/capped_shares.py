"""The capped share tier: claims holding scheduler-accounted parts of one GPU without MPS.

A GPU offered as capped shares (``--capped-shares``; published only where `memory_limits.detect`
found the driver caps a container's memory) carries the same ``memory`` / ``compute``
capacities as an MPS-offered one (`gpu_dra.driver.shares`) and is share-only: a result on it is a
**capped share** (all of the GPU under a config without ``TimeSlicing`` was allocated through a
whole-GPU class before those stopped selecting offered GPUs, and is prepared whole): its config must
have ``sharing.strategy: TimeSlicing`` (the time-slicing tier sets the GPU's interval, reset when
the last claim on it goes); its CDI device gets ``NVIDIA_GPU_MEMORY_LIMIT``/``_REQUEST`` (its
memory, MiB) and the ``apply-cuda-memory-limits`` hook, and no MPS daemon, pipe or variables.
``compute`` is accounted by the scheduler only. Its record keeps the share
(`state.CAPPED_SHARES_STATE_KEY`), so shares of one GPU do not exclude each other. See
docs/shares.md, "Capped shares".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver.config import ConfigGroup
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.shares import ShareError, ShareSize, consumed_share, is_partial
from gpu_dra.kubelet_plugin.checkpoint import JsonValue
from gpu_dra.kubelet_plugin.memory_limits import Enforcement, MemoryLimitSupport
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.protocol import (
    AllocatedResult,
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
    config_group_of,
    share_intents,
)
from gpu_dra.kubelet_plugin.tiers.state import CAPPED_SHARES_STATE_KEY

log = logging.getLogger(__name__)

TIME_SLICING: Final = "TimeSlicing"


@dataclass(frozen=True)
class CappedShare:
    """One capped share a claim is about to get."""

    device_name: str
    gpu: Gpu
    size: ShareSize
    share_id: str | None

    def to_state(self) -> dict[str, JsonValue]:
        return {
            "uuid": self.gpu.uuid,
            "memoryBytes": self.size.memory_bytes,
            "computePercent": self.size.compute_percent,
            "shareID": self.share_id,
        }


@dataclass(frozen=True)
class CappedSharePlan(TierPlan):
    """The capped shares of one claim, by device name."""

    shares: tuple[CappedShare, ...]
    support: MemoryLimitSupport
    report: Callable[[ClaimRef, str], None] | None = None

    @property
    def shared_devices(self) -> frozenset[str]:
        return frozenset(share.device_name for share in self.shares)

    @property
    def changes_node(self) -> bool:
        """False: a cap is container edits only (the interval is the time-slicing tier's,
        whose plan records it)."""
        return False

    def intents(self) -> Mapping[str, JsonValue]:
        return share_intents(CAPPED_SHARES_STATE_KEY, self.shares)

    def apply(self, run: PrepareRun) -> None:
        """Each share's memory cap as CDI edits (the hook); nothing else to make."""
        states: dict[str, JsonValue] = {}
        for share in self.shares:
            uuid, mib = share.gpu.uuid, share.size.memory_mib
            run.edits[share.device_name] = self.support.edits(uuid, mib)
            states[share.device_name] = share.to_state()
            message = (
                f"capped share of {uuid} ({mib} MiB, {share.size.compute_percent} % compute "
                f"accounted, time-sliced): memory capped per container by the driver "
                f"({self.support.why(uuid)}); no MPS daemon"
            )
            log.info("capped share claim_uid=%s device=%s: %s",
                     run.claim.uid, share.device_name, message)  # fmt: skip
            if self.report is not None:
                self.report(run.claim, message)
        if self.shares:
            run.completed[CAPPED_SHARES_STATE_KEY] = states


class CappedShareTier(Tier):
    """`Tier` of capped shares; plan it before the per-claim MPS and time-slicing tiers."""

    def __init__(
        self,
        inventory: NodeInventory,
        support: MemoryLimitSupport | None = None,
        *,
        report: Callable[[ClaimRef, str], None] | None = None,
    ) -> None:
        """``support``: which GPUs the driver caps (`memory_limits.detect`); None: none, so
        that claims with capped shares fail. ``report``: where each share's cap is reported (a
        Kubernetes Event on its claim); None: only logged."""
        self._inventory = inventory
        self._support = support or MemoryLimitSupport(
            default_reason="no GPU is offered as capped shares"
        )
        self._report = report

    def plan(self, request: ClaimRequest, planned: Planned) -> CappedSharePlan:
        try:
            shares = plan_capped_shares(request.results, request.groups, self._inventory.capped_gpu)
        except ShareError as error:
            raise PrepareError(str(error)) from error
        for share in shares:
            uuid = share.gpu.uuid
            if self._support.enforcement(uuid) is not Enforcement.DRIVER:
                # Published only where enforced; a share without the cap is never handed out.
                raise PrepareError(
                    f"device {share.device_name} is a capped share, but the driver does not "
                    f"cap its memory on this node: {self._support.why(uuid)}"
                )
        return CappedSharePlan(tuple(shares), self._support, self._report)


def offer_capped(inventory: NodeInventory, support: MemoryLimitSupport) -> NodeInventory:
    """``inventory`` with only the capped-share GPUs whose memory the driver caps (``support``,
    from `memory_limits.detect`); each GPU left out is logged with why and is published as a
    plain whole GPU."""
    offered = []
    for gpu in inventory.capped_shares:
        if support.enforcement(gpu.uuid) is Enforcement.DRIVER:
            log.info("offering GPU %d (%s) as capped shares: %s", gpu.index, gpu.uuid,
                     support.why(gpu.uuid))  # fmt: skip
            offered.append(gpu)
        else:
            log.warning(
                "GPU %d (%s) is not offered as capped shares (--capped-shares), only whole: the "
                "driver cannot cap its memory per container: %s",
                gpu.index,
                gpu.uuid,
                support.why(gpu.uuid),
            )
    return dataclasses.replace(inventory, capped_shares=tuple(offered))


def plan_capped_shares(
    results: Sequence[AllocatedResult],
    groups: Sequence[ConfigGroup],
    capped_gpu: Callable[[str], Gpu | None],
) -> list[CappedShare]:
    """The results of ``results`` that are capped shares, checked, by device name;
    `PrepareError` (or `ShareError` for an unreadable consumedCapacity) naming the device and
    what to change. ``capped_gpu`` maps a device name to its GPU when it is offered as capped
    shares."""
    planned: dict[str, CappedShare] = {}
    for result in results:
        gpu = capped_gpu(result.device)
        if gpu is None or result.admin_access:
            continue
        size = consumed_share(result.consumed, gpu)
        group = config_group_of(result, groups)
        sharing = None if group is None else getattr(group.config, "sharing", None)
        strategy = None if sharing is None else sharing.strategy
        if not is_partial(size, gpu) and strategy != TIME_SLICING:
            # All of the GPU under a config that is no capped share's: allocated through a
            # whole-GPU class before those stopped selecting offered GPUs; prepared whole.
            continue
        where = f"device {result.device} (request {result.request}, {size})"
        if group is None or strategy != TIME_SLICING:
            raise PrepareError(
                f"{where} is a capped share of the GPU, which is time-sliced, but its config "
                f"has sharing.strategy {strategy or 'none'}; use DeviceClass "
                "capped.gpu.nvidia.com, or a GpuConfig with sharing.strategy TimeSlicing"
            )
        if result.device in planned:
            raise PrepareError(
                f"{where}: the claim holds two capped shares of this GPU; ask for one share of "
                "the combined size in one request"
            )
        planned[result.device] = CappedShare(result.device, gpu, size, result.share_id)
    return [planned[name] for name in sorted(planned)]
