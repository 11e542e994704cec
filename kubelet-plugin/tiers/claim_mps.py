"""The per-claim MPS tier: one MPS control daemon per claim and config group of strategy MPS.

NVIDIA-compatible (``nvidia-compat.md`` §7): a group's full GPUs share one daemon, each MIG
device gets its own (MPS on MIG needs one per MIG device); id `claim_daemon_id(claimUID,
UUIDs)`, defaults from ``mpsConfig``, config errors raised before anything starts. Daemons of
published devices start in `apply`; those of MIG devices made at prepare start once the devices
exist (`apply_to_made`), keyed by their new UUIDs. Each handle is recorded the moment its daemon
answers. Undo stops them; start-up adopts those of prepared claims and removes those no record
names. MPS shares are left to `.mps_shares`. See docs/mps.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from gpu_dra.driver.config import ConfigGroup, mps_config, pinned_memory_limits
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.mps.daemon_model import MpsControl, MpsError, MpsSettings
from gpu_dra.kubelet_plugin.mps.edits import workload_edits
from gpu_dra.kubelet_plugin.mps.ids import claim_daemon_id
from gpu_dra.kubelet_plugin.mps.recorded_daemons import (
    adopt_daemons,
    claim_handles,
    dead_daemons,
    dead_phrase,
    remove_unrecorded,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.tiers.protocol import (
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)
from gpu_dra.kubelet_plugin.tiers.state import MPS_STATE_KEY


@dataclass(frozen=True)
class DaemonPlan:
    """One MPS daemon to start for a claim: its config group's devices and settings."""

    daemon_id: str
    device_names: tuple[str, ...]
    uuids: tuple[str, ...]
    settings: MpsSettings
    deferred: ConfigGroup | None = None
    """A config group with dynamic MIG devices: its daemons are planned and started once the MIG
    devices exist (their UUIDs are known only then); ``daemon_id`` and ``uuids`` are empty."""


@dataclass(frozen=True)
class ClaimMpsPlan(TierPlan):
    """The per-claim MPS daemons of one claim."""

    request: ClaimRequest
    daemons: tuple[DaemonPlan, ...]
    tier: ClaimMpsTier

    @property
    def mps_daemons(self) -> tuple[DaemonPlan, ...]:
        return self.daemons

    @property
    def changes_node(self) -> bool:
        """Whether it starts daemons (the undo stops them)."""
        return bool(self.daemons)

    def apply(self, run: PrepareRun) -> None:
        for daemon in self.daemons:
            if daemon.deferred is None:
                self.tier.start(run, daemon)

    def apply_to_made(self, run: PrepareRun) -> None:
        """The daemons of groups with new MIG devices, keyed by the UUIDs they were made with."""

        def uuid_of(name: str) -> str:
            return run.device(name).uuid

        for pending in self.daemons:
            if pending.deferred is None:
                continue
            for daemon in self.tier.group_daemons(
                self.request, pending.deferred, pending.device_names, uuid_of
            ):
                self.tier.start(run, daemon, crash_points.MPS_MIG_AFTER_DAEMON_START)


class ClaimMpsTier(Tier):
    """`Tier` of per-claim MPS; plan it after the share tiers (their devices are left out).
    Without an MPS control daemon manager, claims asking for MPS fail."""

    def __init__(
        self,
        mps: MpsControl | None,
        inventory: NodeInventory,
        *,
        node_name: str,
        locks: NodeLocks | None = None,
    ) -> None:
        """``locks``: the node's locks; a daemon is started and stopped under its
        ``mps-<daemon id>`` lock, which supervision's repairs take too."""
        self._locks = locks
        self._mps = mps
        self._inventory = inventory
        self._node = node_name

    def plan(self, request: ClaimRequest, planned: Planned) -> ClaimMpsPlan:
        """One daemon per config group with strategy MPS (per MIG device in it), leaving out MPS
        shares. Config errors that need the group's UUIDs are raised here."""
        skip = planned.shared_devices
        admin = {r.device for r in request.results if r.admin_access}
        daemons: list[DaemonPlan] = []
        taken: dict[str, str] = {}
        for group in request.groups:
            if getattr(group.config, "sharing", None) is None or mps_config(group.config) is None:
                continue  # no sharing, or TimeSlicing (`.timeslicing`)
            names = tuple(sorted({d.device for d in group.devices}.difference(skip)))
            if not names:
                continue
            _check_group(group, names, admin, taken)
            if any(isinstance(self._inventory.by_name(n), MigPartition) for n in names):
                daemons.append(DaemonPlan("", names, (), MpsSettings(), deferred=group))
                continue  # planned in `apply_to_made` once the MIG devices exist
            daemons += self.group_daemons(request, group, names, self._uuid)
        if daemons and self._mps is None:
            raise PrepareError(
                f"{daemons[0].daemon_id or ', '.join(daemons[0].device_names)}: MPS is not "
                f"available on node {self._node}: the plugin has no MPS control daemon manager "
                "(see its start-up log)"
            )
        return ClaimMpsPlan(request, tuple(daemons), self)

    def group_daemons(
        self,
        request: ClaimRequest,
        group: ConfigGroup,
        names: Sequence[str],
        uuid_of: Callable[[str], str],
    ) -> list[DaemonPlan]:
        """The daemons for ``names`` of one MPS config group: its full GPUs share one (NVIDIA's
        model); each MIG device gets one of its own (MPS on MIG needs one per MIG device,
        mps.md §8)."""
        mps = mps_config(group.config)
        assert mps is not None  # only groups with strategy MPS get here
        uuids = tuple(sorted(uuid_of(name) for name in names))
        limits = pinned_memory_limits(group, uuids, claim=request.label)
        gpus = tuple(n for n in names if isinstance(self._inventory.by_name(n), Gpu))
        daemons = [gpus] if gpus else []
        daemons += [(n,) for n in names if n not in gpus]
        planned = []
        for daemon_names in daemons:
            daemon_uuids = tuple(sorted(uuid_of(name) for name in daemon_names))
            settings = MpsSettings(
                active_thread_percentage=mps.default_active_thread_percentage,
                pinned_limits={u: v for u, v in limits.items() if u in daemon_uuids},
                multi_user=bool(mps.multi_user),
            )
            settings.check(daemon_uuids)
            daemon_id = claim_daemon_id(request.claim.uid, daemon_uuids)
            planned.append(DaemonPlan(daemon_id, daemon_names, daemon_uuids, settings))
        return planned

    def start(
        self, run: PrepareRun, daemon: DaemonPlan, point: str = crash_points.MPS_AFTER_DAEMON_START
    ) -> None:
        """Start one daemon, record its handle at once (a crash from here on stops it), and give
        the group's devices its workload edits; ``point`` is the `crash_points` name reached
        between the two."""
        assert self._mps is not None  # checked in plan
        with self._daemon_lock(daemon.daemon_id):
            handle = self._mps.start(daemon.daemon_id, daemon.uuids, daemon.settings)
        crash_points.reached(point)
        run.append(MPS_STATE_KEY, handle.to_state())
        run.edits.update(dict.fromkeys(daemon.device_names, workload_edits(handle.paths)))

    def undo(
        self, claim_uid: str, entry: CheckpointEntry | None, pending: Mapping[str, JsonValue]
    ) -> None:
        """Stop the claim's daemons: those recorded and those of ``pending``. One that cannot be
        stopped raises, and the record stays for the next try."""
        handles = claim_handles(entry, pending, shared=False)
        if handles and self._mps is None:
            raise MpsError(
                f"claim {claim_uid} has MPS daemons ({', '.join(h.daemon_id for h in handles)})"
                " but this plugin has no MPS control daemon manager to stop them"
            )
        for handle in handles:
            assert self._mps is not None
            with self._daemon_lock(handle.daemon_id):
                self._mps.stop(handle)
            crash_points.reached(crash_points.MPS_AFTER_DAEMON_STOP)

    def missing(self, entry: CheckpointEntry) -> list[str]:
        return [dead_phrase(h, why) for h, why in dead_daemons(self._mps, entry, shared=False)]

    def adopt(self, entry: CheckpointEntry) -> None:
        adopt_daemons(self._mps, entry, shared=False, lock=self._daemon_lock)

    def sweep(self, entries: Mapping[str, CheckpointEntry]) -> None:
        if self._mps is not None:
            remove_unrecorded(self._mps, entries, shared=False)

    def _daemon_lock(self, daemon_id: str) -> contextlib.AbstractContextManager[None]:
        if self._locks is None:
            return contextlib.nullcontext()
        return self._locks.blocking(f"mps-{daemon_id}")

    def _uuid(self, device_name: str) -> str:
        device = self._inventory.by_name(device_name)
        assert isinstance(device, Gpu | MigDevice)  # checked when the results were read
        return device.uuid


def _check_group(
    group: ConfigGroup, names: Sequence[str], admin: Collection[str], taken: dict[str, str]
) -> None:
    """Refuse MPS on adminAccess devices and a device in two MPS groups (``taken``: device ->
    the group label that has it, updated)."""
    shared = sorted(set(admin).intersection(names))
    if shared:
        raise PrepareError(
            f"{group.origin.label}: MPS cannot be used on devices allocated with "
            f"adminAccess ({', '.join(shared)}): they may belong to another claim"
        )
    for name in names:
        if name in taken:
            raise PrepareError(
                f"{group.origin.label}: device {name} is also in config group "
                f"{taken[name]}; one device can be served by one MPS daemon only"
            )
        taken[name] = group.origin.label
