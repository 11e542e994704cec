"""bench/scheduler_scale.py, its pure parts: /proc parsing, ratios and goal verdicts, the objects
it creates (fake nodes, slices owned by them, claim templates, pods). The benchmark itself needs
the cluster binaries and is run by hand (docs/performance.md, "Scheduler scale"), not in CI."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.scheduler_scale import (
    CLASS_OF_SHAPE,
    LIMITS,
    OWNER_UID_PLACEHOLDER,
    Memory,
    Result,
    bench_pod,
    claim_class,
    claim_template,
    client_pool,
    cpu_ticks,
    fake_node,
    goal_verdicts,
    limit_flags,
    limits_label,
    node_status,
    owned_slices,
    parse_shape,
    ratio_table,
    ratios,
    read_cpu_ticks,
    read_kib,
    read_results,
    report,
    scheduler_config,
    scheduler_port_flags,
    status_kib,
    table,
)
from bench.slice_bytes import SHAPES, node_slices
from gpu_dra.driver.mig_policy import DEFAULT, parse_policy
from tests.fakes.slice_api import validate_slice

STAT = (
    "4242 (kube (sched) uler) S 1 4242 4242 0 -1 4194560 12345 0 0 0 "
    "731 129 0 0 20 0 18 0 5000 123456789 4567 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 "
    "1 0 0 0 0 0"
)


def test_cpu_ticks_are_utime_plus_stime_after_a_command_name_with_spaces_and_parens() -> None:
    assert cpu_ticks(STAT) == 731 + 129


@pytest.mark.parametrize("text", ["", "4242 kube-scheduler S 1", "1 (x) S 1 2 3"])
def test_cpu_ticks_refuses_what_is_not_a_stat_line(text: str) -> None:
    with pytest.raises(ValueError, match="stat"):
        cpu_ticks(text)


def test_this_process_has_cpu_ticks_and_memory() -> None:
    sum(range(200_000))
    assert read_cpu_ticks(os.getpid()) >= 0
    rss = read_kib(os.getpid(), "VmRSS")
    assert 1024 < rss <= read_kib(os.getpid(), "VmHWM")


def test_status_kib_reads_a_field_and_refuses_a_missing_one() -> None:
    status = "Name:\tkube-scheduler\nVmHWM:\t  345678 kB\nVmRSS:\t  123456 kB\nThreads:\t18\n"

    assert status_kib(status, "VmRSS") == 123456
    assert status_kib(status, "VmHWM") == 345678
    with pytest.raises(ValueError, match="no VmSwap"):
        status_kib(status, "VmSwap")
    with pytest.raises(ValueError, match="unit"):
        status_kib("VmRSS:\t12 MB\n", "VmRSS")


def test_shapes_parse_with_an_optional_policy_for_dynamic_mig_only() -> None:
    assert parse_shape("whole").label == "whole"
    assert parse_shape("dynamic-mig").policy == DEFAULT
    assert parse_shape("dynamic-mig").label == "dynamic-mig=1g,2g,3g,4g,7g"  # the default
    four = parse_shape("dynamic-mig=1g,2g,3g,7g")
    assert four.policy == parse_policy("1g,2g,3g,7g")
    assert four.label == "dynamic-mig=1g,2g,3g,7g"
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shape("mig")
    with pytest.raises(ValueError, match="takes no policy"):
        parse_shape("whole=1g")


def test_every_shape_has_a_claim_class() -> None:
    assert set(CLASS_OF_SHAPE) == set(SHAPES)


def test_limits_raise_the_scheduler_and_then_the_controller_manager() -> None:
    assert LIMITS["default"] == (None, None)
    scheduler, manager = LIMITS["scheduler"]
    assert limit_flags(scheduler) == ["--kube-api-qps=1000", "--kube-api-burst=1000"]
    assert limit_flags(manager) == []
    assert limit_flags(LIMITS["raised"][1]) == ["--kube-api-qps=1000", "--kube-api-burst=1000"]


def test_fake_nodes_are_ready_with_room_for_pods() -> None:
    node = fake_node("bench-node-0001")
    status = node_status()["status"]

    assert node["metadata"]["name"] == "bench-node-0001"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "bench-node-0001"
    assert [c["type"] for c in status["conditions"] if c["status"] == "True"] == ["Ready"]
    assert status["allocatable"]["pods"] == "110"


def test_slices_are_the_plugins_owned_by_the_created_node() -> None:
    rendered = node_slices(
        "bench-node-0003", "dynamic-mig", policy=DEFAULT, node_uid=OWNER_UID_PLACEHOLDER
    )
    uid = "11111111-2222-4333-8444-555555555555"

    slices = owned_slices(json.dumps(rendered), uid)

    assert len(slices) == len(rendered)
    for index, (body, original) in enumerate(zip(slices, rendered, strict=True)):
        assert [ref["uid"] for ref in body["metadata"]["ownerReferences"]] == [uid]
        assert body["spec"] == original["spec"]
        assert body["spec"]["nodeName"] == "bench-node-0003"
        validate_slice({**body, "metadata": {**body["metadata"], "name": f"s{index}", "uid": "x"}})


@pytest.mark.parametrize("shape", ["whole", "mps-shares", "dynamic-mig-all", "dynamic-mig"])
def test_each_pod_has_one_claim_from_the_shapes_template(shape: str) -> None:
    template = claim_template(parse_shape(shape))
    pod = bench_pod("pod-00001")

    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == CLASS_OF_SHAPE[shape]
    assert ("capacity" in request["exactly"]) == (shape == "mps-shares")
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}
    ]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]
    tolerated = {t["key"] for t in pod["spec"]["tolerations"]}
    assert tolerated == {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


@pytest.mark.parametrize(
    ("policy", "wanted"),
    [("3g,7g", "mig-3g.gpu.nvidia.com"), ("2g,4g", "mig-2g.gpu.nvidia.com"),
     ("1g,7g", "mig-1g.gpu.nvidia.com")],
)  # fmt: skip
def test_a_policy_without_1g_slices_is_asked_for_its_smallest_profile(
    policy: str, wanted: str
) -> None:
    shape = parse_shape(f"dynamic-mig={policy}")
    classes = {
        device["attributes"]["profile"]["string"].split(".")[0]
        for body in node_slices("n", "dynamic-mig", policy=shape.policy)
        for device in body["spec"].get("devices", [])
        if "profile" in device.get("attributes", {})
    }

    assert claim_class(shape) == wanted
    assert wanted.removeprefix("mig-").split(".")[0] in classes  # every pod can be placed
    request = claim_template(shape)["spec"]["spec"]["devices"]["requests"][0]
    assert request["exactly"]["deviceClassName"] == wanted


def test_the_scheduler_serves_only_pprof_on_loopback_when_profiling() -> None:
    assert scheduler_port_flags(None) == ["--secure-port=0"]
    flags = scheduler_port_flags(12345)
    assert "--secure-port=12345" in flags
    assert "--bind-address=127.0.0.1" in flags
    assert "--authorization-always-allow-paths=/healthz,/debug/pprof/profile" in flags


def test_nodes_to_score_goes_into_a_scheduler_config_with_the_client_limits() -> None:
    config = scheduler_config(Path("/tmp/s.kubeconfig"), (1000, 1000), 10)

    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["percentageOfNodesToScore"] == 10
    assert config["clientConnection"] == {
        "kubeconfig": "/tmp/s.kubeconfig",
        "qps": 1000,
        "burst": 1000,
    }
    assert config["leaderElection"] == {"leaderElect": False}
    # Default limits: the binary's own, so none are written.
    assert scheduler_config(Path("/k"), None, 0)["clientConnection"] == {"kubeconfig": "/k"}
    assert limits_label("raised", None) == "raised"
    assert limits_label("raised", 10) == "raised,score=10%"


def _result(shape: str, limits: str, pods_per_s: float, cpu: float, rss: float) -> Result:
    memory = {
        "kube-scheduler": Memory(rss, rss * 2),
        "kube-apiserver": Memory(300.0, 400.0),
        "etcd": Memory(50.0, 60.0),
    }
    return Result(shape, limits, 500, 1000, 8, 5000, pods_per_s, cpu, memory)


def test_ratios_divide_by_whole_under_the_same_limits() -> None:
    results = [
        _result("whole", "raised", 60.0, 10.0, 100.0),
        _result("dynamic-mig", "raised", 36.0, 15.0, 150.0),
        _result("whole", "default", 12.0, 9.0, 100.0),
        _result("dynamic-mig", "default", 12.0, 30.0, 300.0),
        _result("dynamic-mig-all", "other", 1.0, 1.0, 1.0),  # no baseline: no ratio
    ]

    found = ratios(results)

    assert set(found) == {("raised", "dynamic-mig"), ("default", "dynamic-mig")}
    raised = found[("raised", "dynamic-mig")]
    assert raised["pods_per_s"] == pytest.approx(0.6)
    assert raised["scheduler_cpu_ms_per_pod"] == pytest.approx(1.5)
    assert raised["scheduler_rss_peak"] == pytest.approx(1.5)
    assert raised["slice_bytes_per_node"] == pytest.approx(1.0)
    assert found[("default", "dynamic-mig")]["scheduler_cpu_ms_per_pod"] == pytest.approx(30 / 9)
    assert goal_verdicts(raised) == dict.fromkeys(
        (
            "pods_per_s",
            "scheduler_cpu_ms_per_pod",
            "scheduler_rss_slices_only",
            "scheduler_rss_peak",
        ),
        True,
    )
    default = goal_verdicts(found[("default", "dynamic-mig")])
    assert default["pods_per_s"] is True
    assert default["scheduler_cpu_ms_per_pod"] is False
    assert default["scheduler_rss_peak"] is False
    assert "| raised | dynamic-mig | 0.60x | 1.50x |" in ratio_table(results)
    assert "| raised | whole | 8 | 5.0 | 60.0 | 10.0 | 100 / 200 |" in table(results)


def test_result_lines_read_back_and_report_the_goal(capsys: pytest.CaptureFixture[str]) -> None:
    whole = _result("whole", "raised", 60.0, 10.0, 100.0)
    mig = _result("dynamic-mig=1g,2g,3g,4g,7g", "raised", 20.0, 15.0, 150.0)
    lines = [json.dumps(whole.to_json()), '{"kind": "ratio"}', "", json.dumps(mig.to_json())]

    assert read_results(lines) == [whole, mig]
    report(read_results(lines))
    out = capsys.readouterr().out
    assert "| raised | dynamic-mig=1g,2g,3g,4g,7g | 0.33x | 1.50x |" in out
    assert (
        "issue 15 goal, dynamic-mig=1g,2g,3g,4g,7g under raised limits: not met (pods_per_s)" in out
    )


def test_a_failing_client_pool_drops_its_queued_work() -> None:
    started: list[int] = []
    pools: list[ThreadPoolExecutor] = []
    gate = threading.Event()

    def work(index: int) -> None:
        started.append(index)
        gate.wait(5)

    def fail_with_work_queued() -> None:
        with client_pool(1) as pool:
            pools.append(pool)
            for index in range(50):
                pool.submit(work, index)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fail_with_work_queued()
    gate.set()
    pools[0].shutdown(wait=True)
    assert len(started) <= 1  # at most the one running when the block failed
