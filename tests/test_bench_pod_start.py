"""The pure part of ``bench/pod_start.py``: readiness of a pod, ratios to the pod without a
claim, the report's metrics and targets, the requests it creates. The cluster part is run by
hand on the local e2e cluster (docs/performance.md, "pod_start")."""

from __future__ import annotations

import json

import pytest

from bench import pod_start
from bench.report import Reporter


def pod(phase: str = "Running", ready: str | None = "True") -> dict[str, object]:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "conditions": conditions}}


def test_a_pod_is_ready_only_with_its_ready_condition_true() -> None:
    assert pod_start.is_ready(pod())
    assert not pod_start.is_ready(pod(ready="False"))
    assert not pod_start.is_ready(pod(phase="Pending", ready=None))
    assert not pod_start.is_ready({"metadata": {"name": "p"}})


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_a_pod_that_ended_is_an_error_not_a_wait(phase: str) -> None:
    with pytest.raises(RuntimeError, match=f"pod p ended \\({phase}\\)"):
        pod_start.is_ready(pod(phase=phase))


def test_ratios_are_medians_over_the_pod_without_a_claim() -> None:
    samples = {
        "no_claim": [0.5, 0.6, 0.55],
        "whole_gpu": [0.6, 0.57, 0.66],
        "share": [1.6, 0.66, 0.7],
        "first_share_after_start": [],
    }
    result = pod_start.ratios(samples)
    assert result == pytest.approx({"whole_gpu": 0.6 / 0.55, "share": 0.7 / 0.55})


def test_ratios_need_the_baseline() -> None:
    with pytest.raises(ValueError, match="no no_claim samples"):
        pod_start.ratios({"share": [1.0]})
    with pytest.raises(ValueError, match="median is 0"):
        pod_start.ratios({"no_claim": [0.0], "share": [1.0]})


def test_the_report_judges_shares_against_1_2x(capsys: pytest.CaptureFixture[str]) -> None:
    reporter = Reporter("pod_start", json_lines=True)
    pod_start.report(
        reporter,
        {
            "no_claim": [0.5],
            "whole_gpu": [0.7],
            "share": [0.55],
            "share_beside": [0.5],
            "first_share_after_start": [1.4],
        },
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    metrics = {line["metric"]: line for line in lines}
    assert metrics["share_median"]["value"] == 0.55
    assert metrics["ratio_share"]["value"] == pytest.approx(1.1)
    assert metrics["ratio_share"]["pass"] is True
    assert metrics["ratio_share"]["primary"] is True
    assert metrics["ratio_first_share_after_start"]["pass"] is False
    assert "target" not in metrics["ratio_whole_gpu"]  # reported, not judged
    assert reporter.failed == ["ratio_first_share_after_start"]


def test_the_requests_ask_for_a_share_and_for_one_whole_gpu() -> None:
    share = pod_start.share_request("10Gi", 10)
    assert share["exactly"]["deviceClassName"] == "mps.gpu.nvidia.com"
    assert share["exactly"]["capacity"] == {"requests": {"memory": "10Gi", "compute": "10"}}
    whole = pod_start.whole_request("GPU-1234")
    assert whole["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    [selector] = whole["exactly"]["selectors"]
    assert selector["cel"]["expression"] == "device.attributes['gpu.nvidia.com'].uuid == 'GPU-1234'"


def test_a_partition_share_asks_for_the_7g_partition_of_one_gpu() -> None:
    share = pod_start.partition_share_request("GPU-1234", "10Gi", 10)
    assert share["exactly"]["deviceClassName"] == "mps.mig.nvidia.com"
    assert share["exactly"]["capacity"] == {"requests": {"memory": "10Gi", "compute": "10"}}
    assert [s["cel"]["expression"] for s in share["exactly"]["selectors"]] == [
        "device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
        "device.attributes['gpu.nvidia.com'].parentUUID == 'GPU-1234'",
    ]
    assert pod_start.PARTITION_PLUGIN_ARGS == ("--mps-shares-on-dynamic-mig=7g.80gb",)


def test_partition_shares_are_reported_not_judged(capsys: pytest.CaptureFixture[str]) -> None:
    """A partition's first share makes its MIG device and starts its daemon (never warm): its
    ratio is a measurement, not the GPU shares' 1.2x goal."""
    reporter = Reporter("pod_start", json_lines=True)
    samples = {"no_claim": [0.5], "partition_share": [1.5], "partition_share_beside": [0.6]}
    pod_start.report(reporter, samples, share_cold_starts=5, warm_daemons=False)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    metrics = {line["metric"]: line for line in lines}
    assert metrics["ratio_partition_share"]["value"] == pytest.approx(3.0)
    assert metrics["ratio_partition_share"]["primary"] is True
    assert "target" not in metrics["ratio_partition_share"]
    assert "target" not in metrics["ratio_partition_share_beside"]
    assert reporter.failed == []


def test_the_plugin_offers_gpu_0_as_shares() -> None:
    assert pod_start.BASE_PLUGIN_ARGS == ("--mps-shares=0",)
    assert pod_start.SHARE_GPU == "gpu-0"


def test_both_restart_kinds_are_measured_and_judged() -> None:
    assert pod_start.KINDS[-2:] == ("first_share_after_restart", "first_share_after_start")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), True),  # the plugin's default: always
        (("--mps-share-daemon-warm=off",), False),
        (("--mps-share-daemon-warm=off", "--mps-share-daemon-warm=idle:10m"), True),
        (("--mps-shares=0", "--mps-share-daemon-warm=always"), True),
    ],
)
def test_warm_daemons_are_read_from_the_plugin_args(args: tuple[str, ...], expected: bool) -> None:
    assert pod_start.warm(args) is expected


def test_cold_starts_are_the_shared_daemons_a_prepare_started() -> None:
    log = (
        "2026-11-26 02:30:12,239 INFO gpu_dra.kubelet_plugin.mps.shared_daemons mps shared "
        "daemon started daemon_id=shared-756cd651e2452430 uuid=GPU-2f0c for claim_uid=7952\n"
        "2026-11-26 02:30:39,122 INFO gpu_dra.kubelet_plugin.mps.warm_daemons mps warm daemon "
        "started daemon_id=shared-756cd651e2452430 pid=6073 uuid=GPU-2f0c in 1.236s\n"
        "2026-11-26 02:30:46,316 INFO gpu_dra.kubelet_plugin.mps.shared_daemons mps shared "
        "daemon warm, joined daemon_id=shared-756cd651e2452430 pid=6285 uuid=GPU-2f0c\n"
    )
    assert pod_start.cold_starts(log) == 1
    assert pod_start.cold_starts("") == 0


@pytest.mark.parametrize(
    ("warm", "starts", "failed"), [(True, 0, []), (True, 2, ["share_cold_starts"]), (False, 2, [])]
)
def test_cold_starts_are_judged_only_with_warm_daemons(
    capsys: pytest.CaptureFixture[str], warm: bool, starts: int, failed: list[str]
) -> None:
    reporter = Reporter("pod_start", json_lines=True)
    samples = {"no_claim": [0.5], "share": [0.55]}
    pod_start.report(reporter, samples, share_cold_starts=starts, warm_daemons=warm)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    metrics = {line["metric"]: line for line in lines}
    assert metrics["share_cold_starts"]["value"] == starts
    assert ("target" in metrics["share_cold_starts"]) is warm
    assert reporter.failed == failed
