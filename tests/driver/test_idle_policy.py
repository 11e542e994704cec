"""The idle policy's rules (`driver/cluster/idle_policy.py`): durations, a namespace's opt-in,
when a claim and a pod are idle, and what comes next for a pod."""

from __future__ import annotations

import pytest

from gpu_dra.driver.cluster.idle_policy import (
    CONDITION_TYPE,
    DEFAULT_GRACE_S,
    DEFAULT_MAX_SAMPLE_AGE_S,
    DEFAULT_WINDOW_S,
    GRACE_ANNOTATION,
    LABEL,
    WINDOW_ANNOTATION,
    Action,
    ClaimActivity,
    IdleCondition,
    Mode,
    NamespacePolicy,
    PolicyError,
    Reason,
    claim_activity,
    condition,
    decide,
    duration_text,
    namespace_policy,
    parse_duration,
    pod_idle_since,
    pod_warning,
    policy_state,
    rfc3339,
    warning_message,
)
from tests.fakes.idle_api import gpu_claim

T0 = 1_800_000_000.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(duration_text(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "2", "2 h", "h", "-1h", "0s", "2w", "1h-5m"])
def test_what_is_no_duration(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration such as 90s, 30m, 2h, 1d|not more than 0"):
        parse_duration(text)


def ns(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict:
    return {"metadata": {"name": "ml", "labels": labels or {}, "annotations": annotations or {}}}


def test_a_namespace_without_the_label_did_not_opt_in() -> None:
    assert namespace_policy(ns({"team": "ml"}, {WINDOW_ANNOTATION: "1h"})) is None


def test_the_label_and_annotations_give_the_policy() -> None:
    assert namespace_policy(ns({LABEL: "enabled"})) == NamespacePolicy(
        "ml", Mode.ENABLED, DEFAULT_WINDOW_S, DEFAULT_GRACE_S
    )
    annotated = ns({LABEL: "dry-run"}, {WINDOW_ANNOTATION: "90m", GRACE_ANNOTATION: "1d"})
    assert namespace_policy(annotated) == NamespacePolicy("ml", Mode.DRY_RUN, 5400, 86400)
    assert namespace_policy(ns({LABEL: "enabled"}), default_window_s=60, default_grace_s=5) == (
        NamespacePolicy("ml", Mode.ENABLED, 60, 5)
    )


@pytest.mark.parametrize(
    ("labels", "annotations", "message"),
    [
        ({LABEL: "Enabled"}, {}, "namespace ml: label gpu.nvidia.com/idle-reclaim='Enabled' is "
         "neither 'enabled' nor 'dry-run'; the idle policy leaves the namespace alone until it is"),
        ({LABEL: "enabled"}, {GRACE_ANNOTATION: "soon"}, "namespace ml: annotation "
         "gpu.nvidia.com/idle-grace: 'soon' is not a duration such as 90s, 30m, 2h, 1d or 1h30m"),
    ],
)  # fmt: skip
def test_an_unusable_label_or_annotation_says_which_and_how(
    labels: dict[str, str], annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(PolicyError) as error:
        namespace_policy(ns(labels, annotations))
    assert str(error.value).startswith(message)


FRESH = rfc3339(T0 - 5)
"""A sample the plugin took 5 s before T0."""


def test_a_claim_is_idle_since_its_last_device_went_idle() -> None:
    claim = gpu_claim("ml", "c", pods=("p",), sampled_at=FRESH,
                      devices={"gpu-0": rfc3339(T0 - 50), "gpu-1": rfc3339(T0 - 10)})  # fmt: skip
    activity = claim_activity(claim, now=T0)
    assert activity.holds_devices
    assert activity.idle_since == T0 - 10
    assert activity.idle_for(T0) == 10
    assert [p.name for p in activity.pods] == ["p"]
    assert [p.uid for p in activity.pods] == ["uid-p"]
    assert activity.stale == ()


@pytest.mark.parametrize(
    "devices",
    [
        {"gpu-0": rfc3339(T0), "gpu-1": None},  # one in use
        {"gpu-0": rfc3339(T0), "!gpu-1": None},  # one not reported
        {"gpu-0": "yesterday"},  # idleSince that is no time
    ],
)
def test_a_claim_is_not_idle_unless_every_device_is_reported_idle(
    devices: dict[str, str | None],
) -> None:
    claim = gpu_claim("ml", "c", devices=devices, sampled_at=FRESH)
    assert claim_activity(claim, now=T0).idle_since is None


@pytest.mark.parametrize(
    ("sampled_at", "why"),
    [
        (None, "node-a/gpu-0: Active=False names no sample (data.sampledAt None; a kubelet plugin "
         "older than the idle policy's freshness check?)"),
        ("soon", "node-a/gpu-0: Active=False names no sample (data.sampledAt 'soon'"),
        (rfc3339(T0 - DEFAULT_MAX_SAMPLE_AGE_S - 1), "node-a/gpu-0: Active=False is from a "
         f"sample of {rfc3339(T0 - 127)}, 2m7s ago, older than the policy's bound 2m6s (is the "
         "node's kubelet plugin running and sampling?)"),
    ],
)  # fmt: skip
def test_an_idle_report_of_a_sample_too_old_or_unnamed_is_stale_not_idle(
    sampled_at: str | None, why: str
) -> None:
    claim = gpu_claim("ml", "c", devices={"gpu-0": rfc3339(T0 - 3600)}, sampled_at=sampled_at)
    activity = claim_activity(claim, now=T0)
    assert activity.idle_since is None
    (stale,) = activity.stale
    assert stale.startswith(why)


def test_freshness_is_the_policys_bound_and_a_sample_ahead_of_its_clock_is_fresh() -> None:
    idle = {"gpu-0": rfc3339(T0 - 3600)}
    at_bound = gpu_claim("ml", "c", devices=idle, sampled_at=rfc3339(T0 - 60))
    assert claim_activity(at_bound, now=T0, max_sample_age_s=60).idle_since == T0 - 3600
    assert claim_activity(at_bound, now=T0, max_sample_age_s=59).stale
    ahead = gpu_claim("ml", "c", devices=idle, sampled_at=rfc3339(T0 + 30))  # clocks apart
    assert claim_activity(ahead, now=T0).idle_since == T0 - 3600


def test_a_busy_report_can_be_stale_too_and_unsampled_devices_are_not_stale() -> None:
    busy = gpu_claim("ml", "c", devices={"gpu-0": None}, sampled_at=rfc3339(T0 - 3600))
    assert claim_activity(busy, now=T0).stale[0].startswith("node-a/gpu-0: Active=True is from")
    unsampled = gpu_claim("ml", "c", devices={"!gpu-0": None}, sampled_at=None)
    assert claim_activity(unsampled, now=T0).stale == ()


def test_an_unallocated_claim_holds_no_devices() -> None:
    activity = claim_activity({"metadata": {"name": "c", "namespace": "ml"}}, now=T0)
    assert (activity.holds_devices, activity.idle_since, activity.pods) == (False, None, ())


def activity(idle_since: float | None, holds: bool = True) -> ClaimActivity:
    return ClaimActivity("ml", "c", "u", holds, idle_since, ())


def test_a_pod_is_idle_when_every_claim_with_devices_is() -> None:
    assert pod_idle_since([activity(T0 - 5), activity(T0 - 1)]) == T0 - 1
    assert pod_idle_since([activity(T0 - 5), activity(None)]) is None
    assert pod_idle_since([activity(T0 - 5), activity(None, holds=False)]) == T0 - 5
    assert pod_idle_since([]) is None


ENABLED = NamespacePolicy("ml", Mode.ENABLED, 3600, 600)
DRY_RUN = NamespacePolicy("ml", Mode.DRY_RUN, 3600, 600)


def warned(reason: Reason, since: float | None = T0) -> IdleCondition:
    status = "False" if reason is Reason.ACTIVE else "True"
    return IdleCondition(status, str(reason), since, "")


@pytest.mark.parametrize(
    ("policy", "warning", "idle_since", "now", "action"),
    [
        (ENABLED, None, None, T0, Action.NONE),
        (ENABLED, None, T0 - 3599, T0, Action.NONE),
        (ENABLED, None, T0 - 3600, T0, Action.WARN),
        (ENABLED, warned(Reason.ACTIVE), T0 - 3600, T0, Action.WARN),
        (ENABLED, warned(Reason.IDLE), T0 - 3600, T0 + 599, Action.NONE),
        (ENABLED, warned(Reason.IDLE), T0 - 3600, T0 + 600, Action.EVICT),
        (ENABLED, warned(Reason.EVICTION_BLOCKED), T0 - 3600, T0 + 900, Action.EVICT),
        (ENABLED, warned(Reason.IDLE), None, T0 + 600, Action.CLEAR),
        (ENABLED, warned(Reason.IDLE), T0 - 10, T0, Action.CLEAR),
        (ENABLED, warned(Reason.ACTIVE), None, T0, Action.NONE),
        (ENABLED, warned(Reason.IDLE_DRY_RUN), T0 - 3600, T0 + 900, Action.WARN),
        (ENABLED, warned(Reason.IDLE, since=None), T0 - 3600, T0, Action.WARN),
        (DRY_RUN, None, T0 - 3600, T0, Action.WARN),
        (DRY_RUN, warned(Reason.IDLE_DRY_RUN), T0 - 3600, T0 + 600, Action.WOULD_EVICT),
        (DRY_RUN, warned(Reason.WOULD_BE_BLOCKED), T0 - 3600, T0 + 900, Action.WOULD_EVICT),
        (DRY_RUN, warned(Reason.WOULD_EVICT), T0 - 3600, T0 + 900, Action.NONE),
        (DRY_RUN, warned(Reason.IDLE), T0 - 3600, T0 + 900, Action.WARN),
    ],
)
def test_what_comes_next_for_a_pod(
    policy: NamespacePolicy,
    warning: IdleCondition | None,
    idle_since: float | None,
    now: float,
    action: Action,
) -> None:
    assert decide(policy, warning, idle_since, now) is action


def test_the_condition_round_trips_through_a_pod() -> None:
    written = condition(Reason.EVICTION_BLOCKED, "blocked by a budget", T0)
    assert written["type"] == CONDITION_TYPE
    pod = {"status": {"conditions": [{"type": "Ready", "status": "True"}, written]}}
    assert pod_warning(pod) == IdleCondition("True", "EvictionBlocked", T0, "blocked by a budget")
    assert pod_warning({"status": {}}) is None
    assert condition(Reason.ACTIVE, "used", T0)["status"] == "False"


def pod_with(reason: Reason, mode: Mode = Mode.ENABLED) -> dict:
    message = warning_message(mode, "idle", "nb", T0 + 1800)
    return {"status": {"conditions": [condition(reason, message, T0)]}}


@pytest.mark.parametrize(
    ("label", "pods", "text"),
    [
        (None, [pod_with(Reason.IDLE)], "not opted in"),
        ("yes", [], "invalid label or annotation"),
        ("enabled", [], "enabled: not warned"),
        ("enabled", [pod_with(Reason.ACTIVE)], "enabled: not warned"),
        ("enabled", [pod_with(Reason.IDLE)],
         "warned 2027-01-15T08:00:00Z, evicts at 2027-01-15T08:30:00Z"),
        ("enabled", [pod_with(Reason.EVICTION_BLOCKED)],
         "warned 2027-01-15T08:00:00Z, eviction blocked (PodDisruptionBudget)"),
        ("dry-run", [pod_with(Reason.IDLE_DRY_RUN, Mode.DRY_RUN)],
         "dry-run: warned 2027-01-15T08:00:00Z, would evict at 2027-01-15T08:30:00Z"),
        ("dry-run", [pod_with(Reason.WOULD_EVICT, Mode.DRY_RUN)],
         "dry-run: warned 2027-01-15T08:00:00Z, would have been evicted"),
        ("dry-run", [pod_with(Reason.WOULD_BE_BLOCKED, Mode.DRY_RUN)],
         "dry-run: warned 2027-01-15T08:00:00Z, eviction would be blocked"),
    ],
)  # fmt: skip
def test_where_a_claim_stands_with_the_policy(label: str | None, pods: list, text: str) -> None:
    namespace = None if label is None else ns({LABEL: label})

    state = policy_state(namespace, pods)

    assert state.text == text
    if "evict at" in text or "evicts at" in text:
        assert state.to_json()["evictsAt"] == "2027-01-15T08:30:00Z"
        assert state.to_json()["warnedAt"] == "2027-01-15T08:00:00Z"
