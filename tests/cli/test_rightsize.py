"""`gpu-dra rightsize`: the peaks the kubelet plugin's collector exports (a real sampler over
simulated NVML, read back over HTTP) or a Prometheus query API (a local fake speaking its JSON),
the cluster's slices as the plugin publishes them for simulated nodes, and the advice, sentence
and ResourceClaimTemplate printed per claim."""

from __future__ import annotations

import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from gpu_dra.cli import cluster as cli_cluster
from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.cli.devices import plugin_devices
from gpu_dra.cli.peaks import parse_plugin_metrics
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, SimulatedProcess
from gpu_dra.kubelet_plugin.node_devices import device_name
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, PodRef
from gpu_dra.kubelet_plugin.utilization.metrics import ClaimUtilizationCollector
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from tests.cli.support import run
from tests.fakes.cluster_objects import claim, resource_slice, standard_classes

Obj = dict[str, Any]
GIB = 2**30
DAY = 86400.0
START = 1_700_000_000.0
A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
SHARE_POD = "5a2b3c4d-0000-4000-8000-00000000000a"


def _static_mig(name: str) -> tuple[str, str]:
    """(device name, UUID) of static MIG device `name` on hgx-h100-mig."""
    host = SimulatedHost.load("hgx-h100-mig", "node-c")
    found = discover_devices(host.nvml, host.pci)
    mig = next(m for m in found.mig_devices if device_name(m) == name)
    return device_name(mig), mig.uuid


MIG_DEVICE, MIG_UUID = _static_mig("gpu-1-mig-3g40gb-9-4")
GPM_DEVICE, GPM_UUID = _static_mig("gpu-6-mig-3g40gb-9-4")


def _metrics(
    profile: str,
    node: str,
    held: list[tuple[str, str, str, str | None]],
    activity: Callable[[Any, int], None],
    proc_root: Path,
    samples: int = 2,
) -> str:
    """A plugin's /metrics after `samples` samples a day apart; `held`: (claim, device, tier,
    UUID or None: the GPU's of that name); `activity(nvml, round)` sets each round's use."""
    nvml = SimulatedHost.load(profile, node).nvml
    gpus = {f"gpu-{g.minor}": g.uuid for g in nvml.profile.gpus}
    devices = [
        ClaimDevice(
            ClaimRef("team", f"uid-{name}", name),
            device,
            tier,
            uuid or gpus[device],
            (PodRef(SHARE_POD if tier == "mps-share" else f"uid-pod-{name}", f"{name}-0"),),
            20 * GIB if tier == "mps-share" else None,
            50 if tier == "mps-share" else None,
        )
        for name, device, tier, uuid in held
    ]
    now = [START]
    monitor = UtilizationMonitor(
        UtilizationSampler(nvml, clock=lambda: now[0], proc_root=proc_root),
        lambda: devices,
        interval_s=10,
        idle_threshold_percent=5,
    )
    for round_ in range(samples):
        activity(nvml, round_)
        monitor.sample_once()
        now[0] += DAY
    registry = CollectorRegistry()
    registry.register(ClaimUtilizationCollector(node, lambda: devices, monitor))
    return generate_latest(registry).decode()


def a100_node(proc_root: Path) -> str:
    """dgx-a100: ``notebook`` at most 6 GiB and 12 % (then less), ``idle`` never used, ``share``
    an MPS share (20Gi / 50 %) whose pod used at most 3 GiB and 8 % of the SMs, ``pair`` two
    GPUs of one request at 10 %, one with 2 GiB, one with 30 GiB."""
    pid = 4242
    (proc_root / str(pid)).mkdir(parents=True)
    (proc_root / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{SHARE_POD}/c\n")

    def activity(nvml: Any, round_: int) -> None:
        used = 6 * GIB if round_ == 0 else 2 * GIB
        nvml.set_activity(0, DeviceActivity(12 if round_ == 0 else 3, memory_used_bytes=used,
                                            processes=(SimulatedProcess(1, used),)))  # fmt: skip
        share = SimulatedProcess(pid, 3 * GIB if round_ else GIB, 8 if round_ else 2)
        nvml.set_activity(2, DeviceActivity(20, processes=(share,)))
        for index, gib in ((3, 2), (4, 30)):
            process = SimulatedProcess(index, gib * GIB)
            nvml.set_activity(index, DeviceActivity(10, processes=(process,)))

    held = [
        ("notebook", "gpu-0", "gpu", None),
        ("idle", "gpu-1", "gpu", None),
        ("share", "gpu-2", "mps-share", None),
        ("pair", "gpu-3", "gpu", None),
        ("pair", "gpu-4", "gpu", None),
    ]
    return _metrics("dgx-a100", "node-a", held, activity, proc_root)


def h100_node(proc_root: Path) -> str:
    """hgx-h100: ``train`` at most 70 GiB and 60 %."""

    def activity(nvml: Any, round_: int) -> None:
        train = SimulatedProcess(7, 70 * GIB)
        nvml.set_activity(0, DeviceActivity(60, memory_used_bytes=70 * GIB, processes=(train,)))

    return _metrics("hgx-h100", "node-b", [("train", "gpu-0", "gpu", None)], activity, proc_root)


def mig_node(proc_root: Path) -> str:
    """hgx-h100-mig: ``slice`` on a static 3g.40gb of gpu-1, which answers the GPM query
    NotSupported (as an A100 does: no SM utilization), at most 5 GiB; ``gpm-slice`` on a 3g.40gb
    of gpu-6 (GPM: SM utilization of the instance), at most 5 GiB and 40 % of its SMs."""

    def activity(nvml: Any, round_: int) -> None:
        nvml.set_fault("gpm_query_device_support", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
        process = SimulatedProcess(9, 5 * GIB)
        nvml.set_activity(MIG_UUID, DeviceActivity(processes=(process,)))
        nvml.set_activity(GPM_UUID, DeviceActivity(40, processes=(process,)))

    held = [("slice", MIG_DEVICE, "mig", MIG_UUID), ("gpm-slice", GPM_DEVICE, "mig", GPM_UUID)]
    return _metrics("hgx-h100-mig", "node-c", held, activity, proc_root)


def published(profile: str, node: str, **options: bool) -> Obj:
    host = SimulatedHost.load(profile, node)
    return resource_slice(node, list(plugin_devices(host.nvml, host.pci, **options)))  # type: ignore[arg-type]


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Obj]]:
    """Nodes as the plugin publishes them: A100s offered as MPS shares (no MIG on Ampere), H100s
    with dynamic MIG, H100s with static MIG; the claims allocated there."""
    objects: dict[str, list[Obj]] = {
        "deviceclasses": standard_classes(),
        "resourceslices": [
            published("dgx-a100", "node-a", mps_shares=True),
            published("hgx-h100", "node-b", dynamic_mig=True),
            published("hgx-h100-mig", "node-c"),
        ],
        "resourceclaims": [],
    }
    pair = claim("team", "pair", allocated=[("gpus", "gpu-3"), ("gpus", "gpu-4")], pool="node-a")
    pair["metadata"]["creationTimestamp"] = "2023-01-01T00:00:00Z"
    objects["resourceclaims"].append(pair)
    for name, node, device, request in (
        ("notebook", "node-a", "gpu-0", "gpu"),
        ("idle", "node-a", "gpu-1", "gpu"),
        ("share", "node-a", "gpu-2", "share"),
        ("train", "node-b", "gpu-0", "trainer"),
        ("slice", "node-c", MIG_DEVICE, "mig"),
        ("gpm-slice", "node-c", GPM_DEVICE, "mig"),
    ):
        item = claim("team", name, allocated=[(request, device)], pool=node)
        item["metadata"]["creationTimestamp"] = "2023-01-01T00:00:00Z"
        objects["resourceclaims"].append(item)
    monkeypatch.setattr(cli_cluster, "new_api_client", lambda path: object())
    monkeypatch.setattr(
        cli_cluster, "list_resource_objects", lambda client, plural: objects[plural]
    )
    return objects


def serve(respond: Callable[[str, bytes], tuple[int, bytes]]) -> Iterator[str]:
    """An HTTP server on localhost answering every GET and POST with `respond(path, body)`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, body = respond(self.path, self.rfile.read(length))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def plugins(tmp_path: Path) -> Iterator[list[str]]:
    texts = {
        "/a": a100_node(tmp_path / "proc"),
        "/b": h100_node(tmp_path / "proc"),
        "/c": mig_node(tmp_path / "proc"),
    }
    for base in serve(lambda path, body: (200, texts[path].encode())):
        yield [f"{base}{path}" for path in texts]


def urls(plugins: list[str]) -> list[str]:
    return [arg for url in plugins for arg in ("--plugin-metrics", url)]


def advice_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Obj]:
    code, out, err = run(capsys, "rightsize", *args, "-o", "json")
    assert (code, err) == (EXIT_OK, "")
    data = json.loads(out)
    return {f"{c['namespace']}/{c['name']}": c for c in data["claims"]} | {"": data}


def test_the_plugin_exports_peaks_the_cli_reads(tmp_path: Path) -> None:
    peaks = {p.claim: p for p in parse_plugin_metrics(a100_node(tmp_path / "proc"))}
    notebook, idle, share = peaks["notebook"], peaks["idle"], peaks["share"]
    assert (notebook.memory_used_bytes, notebook.gpu_percent, notebook.tier) == (6 * GIB, 12, "gpu")
    assert (notebook.since, notebook.until, notebook.window_s) == (START, START + DAY, DAY)
    assert (share.memory_used_bytes, share.gpu_percent, share.tier) == (3 * GIB, 8, "mps-share")
    assert share.compute_limit_percent == 50
    assert (idle.processes, idle.gpu_percent) == (0, 0)


def test_a100_at_6gib_and_12_percent_fits_a_1g_slice_or_a_small_share(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    data = advice_json(capsys, *urls(plugins))
    (notebook,) = data["team/notebook"]["devices"]
    assert notebook["product"] == A100
    assert notebook["peak"] == {"memoryUsedBytes": 6 * GIB, "gpuUtilizationPercent": 12,
                                "processes": 1}  # fmt: skip
    assert notebook["windowSeconds"] == DAY
    assert notebook["need"]["memoryBytes"] == pytest.approx(6.6 * GIB)
    assert notebook["need"]["computePercent"] == pytest.approx(13.2)
    options = [(o["kind"], o["profile"], o["memoryBytes"], o["computePercent"], o["offered"])
               for o in notebook["options"]]  # fmt: skip
    assert options == [
        ("mig", "1g.10gb", 9728 * 2**20, pytest.approx(100 / 7), False),  # no MIG on these A100s
        ("mps-share", None, 7 * GIB, 15, True),
        ("gpu", None, 81920 * 2**20, 100, False),  # node-a's GPUs are share-only
    ]
    # the smallest the cluster offers
    assert notebook["recommended"]["kind"] == "mps-share"
    assert notebook["advice"] == (
        "team/notebook (node-a/gpu-0, gpu): used at most 6.0 GiB and 12 % of its "
        f"{A100} over 1d: a 7Gi / 15 % MPS share or a 1g.10gb MIG slice or the whole GPU would "
        "do (with 10 % headroom it needs 6.6 GiB, 13.2 %)"
    )
    template = data["team/notebook"]["template"]
    assert template == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "notebook-rightsized", "namespace": "team"},
        "spec": {"spec": {"devices": {"requests": [{
            "name": "gpu",
            "exactly": {
                "deviceClassName": "mps.gpu.nvidia.com",
                "selectors": [{"cel": {
                    "expression": f"device.attributes['gpu.nvidia.com'].productName == '{A100}'"
                }}],
                "capacity": {"requests": {"memory": "7Gi", "compute": "15"}},
            },
        }]}}},
    }  # fmt: skip
    assert data[""]["headroomPercent"] == 10
    assert "plugins' memory" in data[""]["source"]


def test_h100_at_70gib_needs_the_whole_gpu_or_a_7g_slice(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (train,) = advice_json(capsys, *urls(plugins), "team/train")["team/train"]["devices"]
    assert [(o["kind"], o["profile"], o["offered"]) for o in train["options"]] == [
        ("gpu", None, True),
        ("mig", "7g.80gb", True),  # node-b's dynamic MIG offers it
    ]
    assert train["recommended"]["kind"] == "gpu"
    assert train["advice"].endswith(
        "the whole GPU or a 7g.80gb MIG slice would do (with 10 % headroom it needs 77.0 GiB, 66 %)"
    )
    # no share: 77Gi is more than half the GPU; with 20 % headroom not even the 7g holds it
    (train,) = advice_json(capsys, *urls(plugins), "train", "--headroom", "20")["team/train"][
        "devices"
    ]
    assert [o["kind"] for o in train["options"]] == ["gpu"]
    assert "less than 20 % memory headroom even on the whole GPU" in train["notes"]
    assert "only the whole GPU holds it" in train["advice"]


def test_a_mig_claim_without_utilization_keeps_its_compute(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (mig,) = advice_json(capsys, *urls(plugins), "-n", "team", "slice")["team/slice"]["devices"]
    assert mig["peak"]["gpuUtilizationPercent"] is None
    assert mig["need"]["computeObserved"] is False
    assert mig["need"]["computePercent"] == pytest.approx(100 * 60 / 132)  # 3g.40gb's SMs
    assert "NVML reports no SM utilization on this MIG device" in " ".join(mig["notes"])
    # 5 GiB would fit a 1g.10gb, but its compute was never seen: nothing with fewer SMs
    assert [(o["kind"], o["profile"], o["computePercent"]) for o in mig["options"]] == [
        ("mig", "3g.40gb", pytest.approx(100 * 60 / 132)),
        ("mps-share", None, 50),
        ("gpu", None, 100),
    ]
    request = advice_json(capsys, *urls(plugins), "slice")["team/slice"]["template"]["spec"]
    (exactly,) = [r["exactly"] for r in request["spec"]["devices"]["requests"]]
    assert exactly["deviceClassName"] == "mig-3g.gpu.nvidia.com"
    assert "profile == '3g.40gb'" in exactly["selectors"][0]["cel"]["expression"]


def test_a_hopper_mig_claims_sm_utilization_is_of_its_own_slice(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (mig,) = advice_json(capsys, *urls(plugins), "gpm-slice")["team/gpm-slice"]["devices"]
    assert mig["peak"]["gpuUtilizationPercent"] == 40  # of the 3g.40gb's 60 SMs
    assert mig["need"]["computeObserved"] is True
    # 40 % of 60 of 132 SMs is 18.2 % of the GPU; with 10 % headroom 20 %: more than a
    # 1g.20gb's 26 SMs (19.7 %), a 2g.20gb (32 SMs) holds it
    assert mig["need"]["computePercent"] == pytest.approx(40 * 60 / 132 * 1.1)
    assert [(o["kind"], o["profile"], o["offered"]) for o in mig["options"]] == [
        ("mps-share", None, False),
        ("mig", "2g.20gb", True),
        ("gpu", None, True),
    ]
    assert mig["recommended"]["profile"] == "2g.20gb"  # no H100 is offered as shares
    assert "a 2g.20gb MIG slice is" not in " ".join(mig["notes"])
    assert any("of its own SMs" in note for note in mig["notes"])


def test_an_unused_claim_and_a_share_sized_from_its_own_processes(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    data = advice_json(capsys, *urls(plugins))
    (idle,) = data["team/idle"]["devices"]
    assert idle["unused"] is True
    assert any("unused" in note for note in idle["notes"])
    (share,) = data["team/share"]["devices"]
    assert share["peak"]["gpuUtilizationPercent"] == 8  # its pod's process, not the GPU's 20 %
    assert share["recommended"]["memoryBytes"] == 4 * GIB  # 3 GiB + 10 % -> 4Gi
    assert share["recommended"]["computePercent"] == 10  # 8.8 % -> 10
    (request,) = data["team/share"]["template"]["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "share"  # the claim's request name, so the pods' refs still hold


def test_a_request_of_several_devices_asks_for_as_many_of_the_largest(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pair = advice_json(capsys, *urls(plugins), "pair")["team/pair"]
    small, large = (d["recommended"] for d in pair["devices"])
    assert (small["memoryBytes"], large["memoryBytes"]) == (3 * GIB, 33 * GIB)
    (request,) = pair["template"]["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "gpus"
    assert request["exactly"]["count"] == 2
    assert request["exactly"]["capacity"]["requests"] == {"memory": "33Gi", "compute": "15"}


def test_table_output_sentences_and_templates(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    dead = "http://127.0.0.1:9/metrics"
    code, out, err = run(capsys, "rightsize", *urls(plugins), "--plugin-metrics", dead)
    assert (code, err) == (EXIT_OK, "")
    assert f"warning: cannot read the metrics of {dead}" in out
    assert "right-sizing (peaks from the plugins' memory" in out
    table = out.split("\n\n")[0].splitlines()
    rows = {line.split()[0]: line for line in table if line.startswith("team/")}
    row = rows["team/notebook"]
    assert row.split()[:2] == ["team/notebook", "node-a/gpu-0"]
    assert "6.0 GiB" in row
    assert "12 %" in row
    assert "7Gi / 15 % MPS share" in row
    assert "- (MIG)" in rows["team/slice"]
    assert rows["team/idle"].endswith("a 1Gi / 5 % MPS share (unused)")
    assert (
        "team/notebook (node-a/gpu-0, gpu): used at most 6.0 GiB and 12 % of its "
        f"{A100} over 1d: a 7Gi / 15 % MPS share or" in out
    )
    assert "  template:\n    apiVersion: resource.k8s.io/v1\n" in out
    code, out, _ = run(capsys, "rightsize", *urls(plugins), "--templates")
    templates = list(yaml.safe_load_all(out))
    assert sorted(t["metadata"]["name"] for t in templates) == [
        "gpm-slice-rightsized", "idle-rightsized", "notebook-rightsized", "pair-rightsized",
        "share-rightsized", "slice-rightsized", "train-rightsized",
    ]  # fmt: skip


def test_the_templates_select_devices_of_the_catalog(
    cluster: dict[str, list[Obj]],
    plugins: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """`gpu-dra lint` evaluates the templates' requests, with the shipped DeviceClasses, on the
    simulated profiles: each selects devices (MIG slices, shares, whole GPUs)."""
    code, out, _ = run(capsys, "rightsize", *urls(plugins), "--templates")
    assert code == EXIT_OK
    (tmp_path / "templates.yaml").write_text(out)
    code, out, err = run(capsys, "lint", "deviceclasses/", str(tmp_path / "templates.yaml"))
    assert (code, err) == (EXIT_OK, ""), out
    assert "7 ResourceClaimTemplates" in out
    assert [line for line in out.splitlines() if "templates.yaml" in line] == []  # no finding


def prometheus_answers(queries: list[str]) -> Callable[[str, bytes], tuple[int, bytes]]:
    """A Prometheus query API: the A100 notebook's peaks over the window, as vectors."""
    labels = {"node": "node-a", "namespace": "team", "claim": "notebook", "device": "gpu-0",
              "tier": "gpu"}  # fmt: skip
    now = START + 30 * DAY
    values = {
        "max_over_time(gpu_dra_claim_memory_used_bytes[": 5 * GIB,
        "max_over_time(gpu_dra_claim_memory_used_peak_bytes[": 6 * GIB,
        "max_over_time(gpu_dra_claim_gpu_utilization_percent[": 12,
        "max_over_time(gpu_dra_claim_processes[": 1,
        "min_over_time(gpu_dra_claim_observed_since_timestamp_seconds[": START + 27 * DAY,
    }

    def respond(path: str, body: bytes) -> tuple[int, bytes]:
        assert path == "/api/v1/query"
        (query,) = urllib.parse.parse_qs(body.decode())["query"]
        queries.append(query)
        found = [v for k, v in values.items() if k in query]
        result = [{"metric": labels, "value": [now, str(v)]} for v in found]
        data = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return 200, json.dumps(data).encode()

    return respond


def test_prometheus_gives_the_peaks_over_the_window(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    queries: list[str] = []
    for url in serve(prometheus_answers(queries)):
        data = advice_json(capsys, "--prometheus", url, "--window", "7d")
    # every metric queried is one the plugin exports
    exported = {line.split("{")[0] for line in a100_node(tmp_path / "proc").splitlines()}
    queried = {name for query in queries for name in re.findall(r"gpu_dra_\w+", query)}
    assert len(queried) == 8
    assert queried <= exported
    assert "max by (node, namespace, claim, device, tier) " in queries[0]
    assert all("[604800s]" in query for query in queries)
    assert data[""]["source"].startswith("Prometheus http://127.0.0.1:")
    assert "the last 7d (max_over_time)" in data[""]["source"]
    (notebook,) = data["team/notebook"]["devices"]
    # the larger of the scraped gauge's and the plugin's peak gauge's maxima
    assert notebook["peak"]["memoryUsedBytes"] == 6 * GIB
    # the plugin first sampled it 3 days ago: the window covered is 3 days, not 7
    assert notebook["windowSeconds"] == 3 * DAY
    assert notebook["recommended"]["kind"] == "mps-share"
    # a configured Prometheus is the default
    for url in serve(prometheus_answers(queries)):
        code, out, _ = run(capsys, "rightsize", "-o", "json", GPU_DRA_PROMETHEUS_URL=url)
    assert code == EXIT_OK
    assert json.loads(out)["source"].startswith(f"Prometheus {url}, the last 7d")


def test_prometheus_errors_name_it_and_fail(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(path: str, body: bytes) -> tuple[int, bytes]:
        error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
        return 400, json.dumps(error).encode()

    for url in serve(refuse):
        code, out, err = run(capsys, "rightsize", "--prometheus", url)
    assert (code, out) == (EXIT_FAILED, "")
    assert "--prometheus:" in err
    assert "HTTP 400: bad_data: parse error at char 3" in err
    for url in serve(lambda path, body: (200, b"<html>not prometheus</html>")):
        code, _, err = run(capsys, "rightsize", "--prometheus", url)
    assert code == EXIT_FAILED
    assert "/api/v1/query" in err
    code, _, err = run(capsys, "rightsize", "--prometheus", "http://127.0.0.1:9")
    assert code == EXIT_FAILED
    assert "cannot query http://127.0.0.1:9/api/v1/query" in err


def test_claims_asked_for_without_advice_are_warned_about(
    cluster: dict[str, list[Obj]], plugins: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaims"].append(claim("team", "pending"))
    data = advice_json(capsys, *urls(plugins), "team/train", "pending", "nosuch")
    assert list(data) == ["team/train", ""]
    assert data[""]["warnings"] == [
        "claim pending: no plugin that was read has sampled it (not prepared, or sampling is off)",
        "claim nosuch: no such ResourceClaim",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "7d"], "--window needs --prometheus"),
        (["--prometheus", "http://p", "--window", "soon"], "--window:"),
        (["--headroom", "-5"], "--headroom"),
        (["--headroom", "nan"], "--headroom"),
        (["--prometheus", "prometheus:9090"], "is not an http:// or https:// URL"),
    ],
)
def test_usage_errors(
    cluster: dict[str, list[Obj]],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    code, _, err = run(capsys, "rightsize", *args)
    assert code == EXIT_USAGE
    assert message in err
