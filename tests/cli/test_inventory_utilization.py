"""`gpu-dra inventory --utilization` and `--idle`: the metrics text the kubelet plugin's
collector writes (a real sampler over simulated NVML), read back from an HTTP endpoint or the
apiserver's pod proxy, and the idle rule."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpu_dra.cli import cluster as cli_cluster
from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_OK, EXIT_USAGE
from gpu_dra.cli.utilization import (
    DeviceUse,
    duration_text,
    idle_claims,
    parse_duration,
    parse_metrics,
    read_plugin_pods,
)
from gpu_dra.driver.cluster.idle_policy import LABEL, Mode, Reason, condition, warning_message
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, PodRef
from gpu_dra.kubelet_plugin.utilization.metrics import ClaimUtilizationCollector
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from tests.fakes.cluster_objects import claim, mixed_node, standard_classes

Obj = dict[str, Any]
HOUR = 3600.0


def plugin_metrics_text() -> str:
    """A plugin's /metrics after two samples an hour apart: ``train`` busy throughout,
    ``notebook`` never busy, ``mixed`` with one busy and one idle GPU."""
    nvml = SimulatedHost.load("hgx-h100", "node-a").nvml
    gpus = nvml.profile.gpus

    def held(name: str, index: int) -> ClaimDevice:
        pod = PodRef(f"uid-pod-{name}", f"{name}-0")
        return ClaimDevice(
            ClaimRef("team", f"uid-{name}", name), f"gpu-{gpus[index].minor}", "gpu",
            gpus[index].uuid, (pod,),
        )  # fmt: skip

    devices = [held("train", 0), held("notebook", 1), held("mixed", 2), held("mixed", 3)]
    now = [1000.0]
    monitor = UtilizationMonitor(
        UtilizationSampler(nvml, clock=lambda: now[0]),
        lambda: devices,
        interval_s=10,
        idle_threshold_percent=5,
    )
    for index in (0, 3):
        nvml.set_activity(index, DeviceActivity(gpu_percent=80))
    nvml.set_activity(1, DeviceActivity(gpu_percent=2, memory_used_bytes=2**30))
    monitor.sample_once()
    now[0] += HOUR
    monitor.sample_once()
    registry = CollectorRegistry()
    registry.register(ClaimUtilizationCollector("node-a", lambda: devices, monitor))
    return generate_latest(registry).decode()


@pytest.fixture
def endpoint() -> Iterator[str]:
    text = plugin_metrics_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Obj]]:
    objects: dict[str, list[Obj]] = {
        "deviceclasses": standard_classes(),
        "resourceslices": [mixed_node()],
        "resourceclaims": [],
    }
    for name in ("train", "notebook", "mixed"):
        item = claim("team", name, allocated=[("gpu", "gpu-2")])
        item["metadata"]["creationTimestamp"] = "2026-11-20T08:00:00Z"
        objects["resourceclaims"].append(item)
    objects["namespaces"] = []
    objects["pods"] = []
    monkeypatch.setattr(cli_cluster, "new_api_client", lambda path: object())
    monkeypatch.setattr(
        cli_cluster, "list_resource_objects", lambda client, plural: objects[plural]
    )

    def read_idle_policy(
        client: object, pods: list[tuple[str, str]]
    ) -> tuple[dict[str, Obj], dict[tuple[str, str], Obj]]:
        if objects.get("refuse"):
            raise ApiError("list Namespaces labelled gpu.nvidia.com/idle-reclaim: 403 Forbidden")
        namespaces = {n["metadata"]["name"]: n for n in objects["namespaces"]}
        known = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in objects["pods"]}
        return namespaces, {
            key: known[key] for key in pods if key in known and key[0] in namespaces
        }

    monkeypatch.setattr(cli_cluster, "read_idle_policy", read_idle_policy)
    return objects


def test_the_cli_reads_what_the_plugin_exports() -> None:
    uses = {(u.claim, u.device): u for u in parse_metrics(plugin_metrics_text())}
    assert set(uses) == {
        ("train", "gpu-0"),
        ("notebook", "gpu-1"),
        ("mixed", "gpu-2"),
        ("mixed", "gpu-3"),
    }
    train, notebook = uses[("train", "gpu-0")], uses[("notebook", "gpu-1")]
    assert (train.gpu_percent, train.idle_for_s, train.pod, train.tier) == (80, 0, "train-0", "gpu")
    assert (notebook.gpu_percent, notebook.idle_for_s) == (2, HOUR)
    assert notebook.memory_used_bytes == 2**30
    assert [c.claim for c in idle_claims(uses.values(), 30 * 60)] == ["notebook"]
    assert idle_claims(uses.values(), 2 * HOUR) == []


def test_a_device_never_sampled_keeps_its_claim_out_of_the_idle_list() -> None:
    sampled = DeviceUse("n", "ns", "c", "gpu-0", last_active=0, sampled_at=HOUR)
    unknown = DeviceUse("n", "ns", "c", "gpu-1")
    assert idle_claims([sampled], 60)[0].idle_for_s == HOUR
    assert idle_claims([sampled, unknown], 60) == []


def test_idle_view_lists_idle_claims_with_age_and_holdings(
    cluster: dict[str, list[Obj]], endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["inventory", "--idle", "--idle-for", "45m", "--plugin-metrics", endpoint]
    assert main(args, environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert "every device idle for at least 45m" in out
    (row,) = [line for line in out.splitlines() if line.startswith("team/")]
    assert row.split()[:3] == ["team/notebook", *row.split()[1:2], "node-a/gpu-1"]
    assert "notebook-0" in row
    assert "1h" in row
    assert main([*args, "-o", "json"], environ={}) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    (idle,) = data["idleClaims"]
    assert (idle["namespace"], idle["name"], idle["idleSeconds"]) == ("team", "notebook", HOUR)
    assert idle["ageSeconds"] > 0
    assert data["warnings"] == []


def test_utilization_columns_and_unreachable_plugins_are_warned_about(
    cluster: dict[str, list[Obj]], endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = "http://127.0.0.1:9/metrics"
    args = ["inventory", "--utilization", "--plugin-metrics", endpoint, "--plugin-metrics", dead]
    assert main(args, environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert f"warning: cannot read the metrics of {dead}" in out
    (train,) = [line for line in out.splitlines() if line.startswith("team/train")]
    assert train.split()[1:6] == ["train-0", "node-a", "gpu-0", "gpu", "80%"]
    assert "device classes:" in out  # the usual inventory is still there
    assert main([*args, "-o", "json"], environ={}) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert len(data["claimUtilization"]) == 4
    assert len(data["warnings"]) == 1


def test_bad_idle_window_is_a_usage_error(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inventory", "--idle", "--idle-for", "soon"], environ={}) == EXIT_USAGE
    assert "--idle-for" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1d", 86400),
        ("1d12h", 129600),
        ("2d3h4m5s", 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
        ("1.5d", 129600),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "d", "1x", "12h1d", "1h1h", "1d 2h", "-1h"])
def test_parse_duration_refuses_what_is_no_duration(text: str) -> None:
    with pytest.raises(ValueError, match="1d12h"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [40, 720, 3900, 7200, 86400, 36 * HOUR, 5 * 86400 + 2 * HOUR])
def test_every_duration_the_output_prints_is_accepted_as_a_window(seconds: float) -> None:
    assert parse_duration(duration_text(seconds)) == seconds


def test_idle_for_takes_days_as_the_output_prints_them(
    cluster: dict[str, list[Obj]], endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["inventory", "--idle", "--idle-for", "1d12h", "--plugin-metrics", endpoint]
    assert main(args, environ={}) == EXIT_OK
    assert "every device idle for at least 1d12h" in capsys.readouterr().out
    assert main([*args, "-o", "json"], environ={}) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["idleForSeconds"] == 36 * HOUR
    assert data["idleClaims"] == []  # the notebook has been idle for an hour only


@pytest.mark.parametrize(
    ("seconds", "text"), [(40, "40s"), (720, "12m"), (3900, "1h5m"), (5 * 86400 + 7300, "5d2h")]
)
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


class FakePod:
    def __init__(self, name: str, port: int | None) -> None:
        self.metadata = type("M", (), {"name": name, "namespace": "gpu-dra"})()
        ports = (
            [] if port is None else [type("P", (), {"name": "metrics", "container_port": port})()]
        )
        self.spec = type("S", (), {"containers": [type("C", (), {"ports": ports})()]})()


def test_plugin_pods_are_read_through_the_pod_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str]] = []
    text = plugin_metrics_text()

    class FakeCore:
        def __init__(self, client: object) -> None:
            pass

        def list_pod_for_all_namespaces(self, label_selector: str) -> Any:
            assert label_selector == "app.kubernetes.io/component=kubelet-plugin"
            return type("L", (), {"items": [FakePod("p-a", 8081), FakePod("p-b", None)]})()

        def connect_get_namespaced_pod_proxy_with_path(
            self, name: str, namespace: str, path: str
        ) -> str:
            calls.append((name, namespace, path))
            return text

    monkeypatch.setattr(kubernetes.client, "CoreV1Api", FakeCore)
    scrapes = read_plugin_pods(object(), "app.kubernetes.io/component=kubelet-plugin", None)
    assert calls == [("p-a:8081", "gpu-dra", "metrics")]
    assert scrapes[0].text == text
    assert scrapes[1].error == "no container port named metrics"


def test_idle_view_says_where_each_claim_stands_with_the_idle_policy(
    cluster: dict[str, list[Obj]], endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["inventory", "--idle", "--idle-for", "45m", "--plugin-metrics", endpoint]
    assert main(args, environ={}) == EXIT_OK
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("team/")]
    assert row.endswith("not opted in")

    cluster["namespaces"] = [
        {"metadata": {"name": "team", "labels": {LABEL: "enabled"}}},
    ]
    warned = condition(
        Reason.IDLE,
        warning_message(Mode.ENABLED, "idle", "notebook-pod", 1_800_001_800.0),
        1_800_000_000.0,
    )
    cluster["pods"] = [
        {"metadata": {"name": "notebook-pod", "namespace": "team"},
         "status": {"conditions": [warned]}},
    ]  # fmt: skip
    assert main(args, environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert "POLICY" in out
    (row,) = [line for line in out.splitlines() if line.startswith("team/")]
    assert row.endswith("warned 2027-01-15T08:00:00Z, evicts at 2027-01-15T08:30:00Z")
    assert main([*args, "-o", "json"], environ={}) == EXIT_OK
    (idle,) = json.loads(capsys.readouterr().out)["idleClaims"]
    assert idle["policy"]["mode"] == "enabled"
    assert idle["policy"]["reason"] == "Idle"
    assert idle["policy"]["evictsAt"] == "2027-01-15T08:30:00Z"

    cluster["refuse"] = True  # type: ignore[assignment]
    assert main(args, environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert "warning: cannot read the idle policy's state (POLICY shows ?): list Namespaces" in out
    (row,) = [line for line in out.splitlines() if line.startswith("team/")]
    assert row.endswith("?")
