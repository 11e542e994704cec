"""driver.health: XID classification, the health state, and what it means per published device."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpu_dra.driver.health import (
    DEFAULT_IGNORED_XIDS,
    KEY_ECC,
    KEY_GPU_LOST,
    KEY_MPS_DAEMON,
    KEY_XID,
    MAX_MESSAGE,
    RECOVERY,
    DeviceHealth,
    DeviceScope,
    HealthPolicy,
    HealthState,
    HealthStatus,
    Problem,
    Severity,
    TaintEffect,
    Target,
    classify_event,
    device_health,
    device_taints,
    gpu_lost,
    parse_taint_effect,
    parse_xids,
    rfc3339,
    unmonitored,
)
from gpu_dra.driver.nvml.interface import (
    EVENT_TYPE_SIMULATED_RECOVERY,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)

XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR
T0 = datetime(2026, 7, 22, 2, 24, 46, 123456, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
POLICY = HealthPolicy()
GPU0, GPU1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


def xid(code: int, at: datetime = T0, policy: HealthPolicy = POLICY) -> Problem:
    found = classify_event(XID, code, policy, at)
    assert isinstance(found, Problem)
    return found


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68, 109])
def test_nvidias_application_error_xids_are_ignored_by_default(code: int) -> None:
    assert code in DEFAULT_IGNORED_XIDS
    assert classify_event(XID, code, POLICY, T0) is None


def test_xid_79_means_the_gpu_is_lost() -> None:
    problem = xid(79)
    assert (problem.key, problem.value, problem.severity) == (KEY_XID, "79", Severity.LOST)
    assert problem.message == "critical XID 79 (GPU has fallen off the bus) reported by NVML"


@pytest.mark.parametrize("code", [48, 63, 74, 94, 119, 12345])
def test_other_critical_xids_degrade_the_gpu(code: int) -> None:
    problem = xid(code)
    assert (problem.key, problem.value, problem.severity) == (KEY_XID, str(code), Severity.DEGRADED)
    assert f"critical XID {code}" in problem.message


def test_the_ignored_list_is_configurable() -> None:
    policy = HealthPolicy(ignored_xids=frozenset({48}))
    assert classify_event(XID, 48, policy, T0) is None
    assert xid(13, policy=policy).severity is Severity.DEGRADED


def test_ecc_events_double_bit_degrades_single_bit_is_corrected() -> None:
    problem = classify_event(NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR, 0, POLICY, T0)
    assert isinstance(problem, Problem)
    assert (problem.key, problem.severity) == (KEY_ECC, Severity.DEGRADED)
    assert classify_event(NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR, 0, POLICY, T0) is None


def test_the_simulators_recovery_event_is_a_recovery() -> None:
    assert classify_event(EVENT_TYPE_SIMULATED_RECOVERY, 0, POLICY, T0) is RECOVERY


def test_effects_by_severity_default_and_configured() -> None:
    assert POLICY.effect(Severity.DEGRADED) is TaintEffect.NO_SCHEDULE
    assert POLICY.effect(Severity.LOST) is TaintEffect.NO_EXECUTE
    assert POLICY.effect(Severity.UNMONITORED) is None
    custom = HealthPolicy(degraded_effect=TaintEffect.NONE, lost_effect=TaintEffect.NO_SCHEDULE)
    assert custom.effect(Severity.DEGRADED) is TaintEffect.NONE
    assert custom.effect(Severity.LOST) is TaintEffect.NO_SCHEDULE


def test_parsing_effects_and_xid_lists() -> None:
    assert parse_taint_effect("noexecute", "--x") is TaintEffect.NO_EXECUTE
    assert parse_taint_effect("None", "--x") is TaintEffect.NONE
    with pytest.raises(ValueError, match="--x must be one of None, NoSchedule, NoExecute"):
        parse_taint_effect("PreferNoSchedule", "--x")
    assert parse_xids(" 13, 31 ,,", "--x") == {13, 31}
    assert parse_xids("", "--x") == frozenset()
    with pytest.raises(ValueError, match="'x13' is not an XID"):
        parse_xids("x13", "--x")


def test_a_later_milder_event_never_weakens_a_problem() -> None:
    state = HealthState().with_problem(Target(GPU0), xid(79, T0))
    assert state.with_problem(Target(GPU0), xid(48, T1)) is state
    worse = HealthState().with_problem(Target(GPU0), xid(48, T0))
    worse = worse.with_problem(Target(GPU0), xid(79, T1))
    assert worse.of(Target(GPU0))[KEY_XID].value == "79"
    assert worse.of(Target(GPU0))[KEY_XID].since == T1  # a new severity starts a new taint


def test_the_same_severity_updates_the_value_and_keeps_when_it_began() -> None:
    state = HealthState().with_problem(Target(GPU0), xid(48, T0))
    state = state.with_problem(Target(GPU0), xid(94, T1))
    problem = state.of(Target(GPU0))[KEY_XID]
    assert (problem.value, problem.since) == ("94", T0)
    assert state.with_problem(Target(GPU0), xid(94, T1)) is state


def test_recovery_clears_nvml_problems_of_the_gpu_and_its_mig_devices_only() -> None:
    state = (
        HealthState()
        .with_problem(Target(GPU0), xid(48))
        .with_problem(Target(GPU0, (1, 0)), xid(94))
        .with_problem(Target(GPU0), gpu_lost("test", T0))
        .with_problem(Target(GPU1), xid(79))
        .with_mps_daemons([GPU0], {GPU0: "pod gone"}, T0)
    )
    recovered = state.recovered(GPU0)
    assert set(recovered.of(Target(GPU0))) == {KEY_MPS_DAEMON}
    assert recovered.of(Target(GPU0, (1, 0))) == {}
    assert set(recovered.of(Target(GPU1))) == {KEY_XID}


def test_mps_daemon_problems_follow_the_liveness_check() -> None:
    state = HealthState().with_mps_daemons([GPU0, GPU1], {GPU1: "pid 42 is gone"}, T0)
    problem = state.of(Target(GPU1))[KEY_MPS_DAEMON]
    assert problem.message == "MPS daemon not running: pid 42 is gone"
    assert problem.severity is Severity.DEGRADED
    assert state.of(Target(GPU0)) == {}
    again = state.with_mps_daemons([GPU0, GPU1], {GPU1: "still gone"}, T1)
    assert again.of(Target(GPU1))[KEY_MPS_DAEMON].since == T0
    assert state.with_mps_daemons([GPU0, GPU1], {}, T1).problems == {}


SCOPES = [
    DeviceScope("gpu-0", GPU0),  # e.g. a dynamic-MIG GPU's whole device ...
    DeviceScope("gpu-0-mig-1g10gb-19-0", GPU0),  # ... and one of its partitions
    DeviceScope("gpu-1-mig-1g10gb-19-0", GPU1, (7, 0)),  # static MIG devices of GPU 1
    DeviceScope("gpu-1-mig-3g40gb-9-4", GPU1, (2, 0)),
]


def test_a_gpu_problem_goes_to_every_device_of_the_gpu() -> None:
    health = device_health(HealthState().with_problem(Target(GPU1), xid(79)), SCOPES)
    assert {name for name, h in health.items() if h.problems} == {
        "gpu-1-mig-1g10gb-19-0",
        "gpu-1-mig-3g40gb-9-4",
    }
    assert health["gpu-1-mig-3g40gb-9-4"].status is HealthStatus.UNHEALTHY
    assert health["gpu-0"].status is HealthStatus.HEALTHY


def test_a_mig_problem_goes_to_that_mig_device_only() -> None:
    health = device_health(HealthState().with_problem(Target(GPU1, (2, 0)), xid(94)), SCOPES)
    assert {name for name, h in health.items() if h.problems} == {"gpu-1-mig-3g40gb-9-4"}


def test_a_mig_problem_of_an_unpublished_instance_counts_for_the_whole_gpu() -> None:
    # A dynamic-MIG instance is published as a partition, not by its instance ids.
    health = device_health(HealthState().with_problem(Target(GPU0, (3, 0)), xid(94)), SCOPES)
    assert {name for name, h in health.items() if h.problems} == {"gpu-0", "gpu-0-mig-1g10gb-19-0"}


PARTITION = DeviceScope("gpu-0-mig-3g40gb-9-4", GPU0, placement=(9, 4))


def test_a_partition_daemon_problem_goes_to_that_partition_only() -> None:
    """A dead MPS daemon of the MIG device made from a partition offered as shares."""
    made = {"MIG-a": Target(GPU0, placement=(9, 4))}
    state = HealthState().with_mps_daemons([], {"MIG-a": "pod gone"}, T0, made)
    health = device_health(state, [*SCOPES, PARTITION])
    assert {name for name, h in health.items() if h.problems} == {"gpu-0-mig-3g40gb-9-4"}
    assert health["gpu-0-mig-3g40gb-9-4"].problems[0].key == KEY_MPS_DAEMON
    # A GPU problem still reaches the partition; recovery leaves the daemon's problem.
    both = state.with_problem(Target(GPU0), xid(48)).recovered(GPU0)
    assert set(both.of(Target(GPU0, placement=(9, 4)))) == {KEY_MPS_DAEMON}
    # Alive again: gone. So it is once the MIG device (its last share) is gone.
    assert state.with_mps_daemons([], {}, T1, made).problems == {}
    assert state.with_mps_daemons([], {"MIG-a": "pod gone"}, T1, {}).problems == {}


def test_a_partition_problem_no_published_partition_matches_counts_for_the_gpu() -> None:
    state = HealthState().with_problem(Target(GPU0, placement=(9, 4)), xid(94))
    health = device_health(state, SCOPES)  # the partition is not published (policy changed)
    assert {name for name, h in health.items() if h.problems} == {"gpu-0", "gpu-0-mig-1g10gb-19-0"}


def test_the_worst_problem_per_key_wins_on_a_device() -> None:
    state = (
        HealthState()
        .with_problem(Target(GPU1), xid(48, T1))
        .with_problem(Target(GPU1, (2, 0)), xid(79, T0))
    )
    (problem,) = device_health(state, SCOPES)["gpu-1-mig-3g40gb-9-4"].problems
    assert problem.value == "79"


def test_taints_carry_the_key_value_effect_and_when_the_problem_began() -> None:
    state = (
        HealthState()
        .with_problem(Target(GPU1), xid(79))
        .with_problem(
            Target(GPU1), classify_event(NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR, 0, POLICY, T1)
        )  # type: ignore[arg-type]
        .with_problem(Target(GPU0), gpu_lost("nvmlEventSetWait", T1))
    )
    taints = device_taints(device_health(state, SCOPES), POLICY, "gpu.nvidia.com")
    assert taints["gpu-1-mig-1g10gb-19-0"] == [
        {
            "key": "gpu.nvidia.com/ecc",
            "value": "double-bit",
            "effect": "NoSchedule",
            "timeAdded": "2026-07-22T02:29:46Z",
        },
        {
            "key": "gpu.nvidia.com/xid",
            "value": "79",
            "effect": "NoExecute",
            "timeAdded": "2026-07-22T02:24:46Z",
        },
    ]
    assert taints["gpu-0"] == [
        {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoExecute", "timeAdded": rfc3339(T1)}
    ]
    assert set(taints) == {scope.name for scope in SCOPES}


def test_unmonitored_gpus_get_no_taint_and_unknown_health() -> None:
    state = HealthState().with_problem(
        Target(GPU0), unmonitored("nvmlEventSetCreate: NOT_SUPPORTED", T0)
    )
    health = device_health(state, SCOPES)
    assert health["gpu-0"].status is HealthStatus.UNKNOWN
    assert health["gpu-0"].message == "health not monitored: nvmlEventSetCreate: NOT_SUPPORTED"
    assert device_taints(health, POLICY, "gpu.nvidia.com") == {}


def test_a_lost_gpu_outranks_unknown_health() -> None:
    state = (
        HealthState()
        .with_problem(Target(GPU0), unmonitored("x", T0))
        .with_problem(Target(GPU0), gpu_lost("y", T0))
    )
    health = device_health(state, SCOPES)["gpu-0"]
    assert health.status is HealthStatus.UNHEALTHY
    assert [p.key for p in health.problems] == [KEY_GPU_LOST, "unmonitored"]


def test_long_messages_are_cut_where_the_kubelet_cuts_them() -> None:
    many = tuple(Problem(f"k{i}", "", Severity.DEGRADED, "m" * 100, T0) for i in range(20))
    message = DeviceHealth(many).message
    assert len(message) == MAX_MESSAGE
    assert message.endswith("...")
