"""`gpu-dra explain` pure logic (`cli/explain.py`) on hand-built raw objects, and the
``explain`` / ``inventory`` commands with the cluster reads replaced by those objects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_dra.cli import cluster as cli_cluster
from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.cli.explain import Explanation, capacity_fits, explain, render_explanation
from gpu_dra.driver.attributes import gpu_device
from gpu_dra.driver.cel import Selector
from gpu_dra.driver.cluster.state import PoolDevice
from gpu_dra.driver.shares import offered_device
from gpu_dra.kube.errors import NotFoundError
from tests.cli.support import FakeCoreV1
from tests.fakes.cluster_objects import (
    DRIVER,
    Obj,
    a100,
    claim,
    device_class,
    exactly,
    gpu,
    l4,
    mixed_node,
    resource_slice,
    standard_classes,
)
from tests.fakes.gpus import h100

L4 = f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4'"
A100 = f"device.attributes['{DRIVER}'].productName.startsWith('NVIDIA A100')"
FUTURE_DRIVER = f"device.attributes['{DRIVER}'].driverVersion.compareTo(semver('999.0.0')) >= 0"


def run_explain(target: Obj, *, slices: list[Obj], claims: list[Obj] | None = None) -> Explanation:
    return explain(target, standard_classes(), slices, [target, *(claims or [])])


def step(report: Explanation, name: str, request: int = 0, alternative: int = 0) -> Any:
    steps = report.requests[request].alternatives[alternative].steps
    return next(s for s in steps if s.name == name)


def test_an_unsatisfiable_selector_passes_no_device_and_is_named() -> None:
    target = claim("ns", "future", [exactly("gpu", "gpu.nvidia.com", FUTURE_DRIVER)])
    report = run_explain(target, slices=[mixed_node()])
    assert not report.allocated
    class_step = step(report, "class gpu.nvidia.com selector #0")
    assert (class_step.entered, class_step.passed) == (4, 4)
    selector_step = step(report, "request selector #0")
    assert (selector_step.passed, selector_step.rejected) == (0, 4)
    assert "999.0.0" in selector_step.detail
    assert not report.requests[0].satisfied
    verdict = report.requests[0].verdict()
    assert verdict.startswith("request gpu: 0 of 4 devices pass (needs 1): 4 rejected by request ")
    assert "semver('999.0.0')" in verdict
    assert report.verdict.startswith("claim ns/future cannot be allocated now: request gpu: 0 of 4")


def test_devices_all_taken_names_the_claims_holding_them() -> None:
    holders = [
        claim("team-a", "first", allocated=[("gpu", "gpu-2")]),
        claim("team-b", "second", allocated=[("gpu", "gpu-3")]),
    ]
    target = claim("ns", "want-l4", [exactly("gpu", "gpu.nvidia.com", L4)])
    report = run_explain(target, slices=[mixed_node()], claims=holders)
    free = step(report, "not allocated")
    assert (free.entered, free.passed, free.rejected) == (2, 0, 2)
    assert free.holders == ["team-a/first", "team-b/second"]
    alternative = report.requests[0].alternatives[0]
    assert alternative.allocated == [
        "gpu.nvidia.com/node-a/gpu-2 -> team-a/first",
        "gpu.nvidia.com/node-a/gpu-3 -> team-b/second",
    ]
    assert "2 allocated to other claims (team-a/first, team-b/second)" in report.verdict
    # An A100 claim is not affected by the L4 holders.
    other = claim("ns", "want-a100", [exactly("gpu", "gpu.nvidia.com", A100)])
    assert run_explain(other, slices=[mixed_node()], claims=holders).requests[0].satisfied


def test_admin_access_ignores_allocations() -> None:
    holders = [claim("t", "x", allocated=[("gpu", "gpu-2"), ("gpu", "gpu-3")])]
    target = claim("ns", "admin", [exactly("gpu", "gpu.nvidia.com", L4, adminAccess=True)])
    report = run_explain(target, slices=[mixed_node()], claims=holders)
    assert step(report, "not allocated").passed == 2
    assert report.requests[0].satisfied


def test_runtime_cel_errors_are_counted_with_one_example() -> None:
    unnamed = gpu("gpu-9")
    del unnamed["attributes"]["productName"]
    target = claim("ns", "c", [exactly("gpu", "gpu.nvidia.com", L4)])
    report = run_explain(target, slices=[resource_slice("node-a", [l4("gpu-0"), unnamed])])
    selector_step = step(report, "request selector #0")
    assert (selector_step.passed, selector_step.rejected, selector_step.errors) == (1, 0, 1)
    assert selector_step.error_example.startswith("gpu.nvidia.com/node-a/gpu-9: ")
    assert "no such key: productName" in selector_step.error_example
    assert "1 CEL runtime errors in request selector #0" in report.requests[0].verdict()
    rendered = [b for b in render_explanation(report) if isinstance(b, str)]
    assert any(
        "1 CEL runtime errors in request selector #0, e.g. gpu.nvidia" in b for b in rendered
    )


def test_compile_errors_and_unknown_classes_are_problems() -> None:
    target = claim(
        "ns",
        "c",
        [exactly("a", "gpu.nvidia.com", "device.driver =="), exactly("b", "no-such-class")],
    )
    report = run_explain(target, slices=[mixed_node()])
    first, second = report.requests
    assert first.alternatives[0].problem.startswith("request selector #0 does not compile: ")
    assert second.alternatives[0].problem == "DeviceClass no-such-class does not exist"
    assert "request b: DeviceClass no-such-class does not exist" in report.verdict


def test_an_allocated_claim_shows_its_allocation_first() -> None:
    target = claim("ns", "mine", allocated=[("gpu", "gpu-1")])
    other = claim("ns", "theirs", allocated=[("gpu", "gpu-0")])
    report = run_explain(target, slices=[mixed_node()], claims=[other])
    assert report.allocated
    assert report.allocation == [{"request": "gpu", "device": "gpu.nvidia.com/node-a/gpu-1"}]
    assert report.verdict == (
        "claim ns/mine is allocated: gpu -> gpu.nvidia.com/node-a/gpu-1; reserved for pods/mine-pod"
    )
    # Its own device is not "allocated to another claim"; the other claim's is.
    assert step(report, "not allocated").holders == ["ns/theirs"]
    assert report.requests[0].alternatives[0].allocated == [
        "gpu.nvidia.com/node-a/gpu-0 -> ns/theirs",
        "gpu.nvidia.com/node-a/gpu-1 -> this claim",
    ]
    blocks = render_explanation(report)
    assert blocks[0] == f"verdict: {report.verdict}"
    assert blocks[1] == "allocation:"
    assert report.to_json()["allocated"] is True


def test_first_available_tries_subrequests_in_order() -> None:
    request = {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": "h100",
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [{"cel": {"expression": f"{L4.replace('NVIDIA L4', 'NVIDIA H100')}"}}],
            },
            {"name": "l4", "deviceClassName": "gpu.nvidia.com", "count": 2, "selectors": [
                {"cel": {"expression": L4}}
            ]},
        ],
    }  # fmt: skip
    target = claim("ns", "fa", [request])
    report = run_explain(target, slices=[mixed_node()])
    (result,) = report.requests
    assert result.first_available
    assert [a.name for a in result.alternatives] == ["gpu/h100", "gpu/l4"]
    assert [a.satisfied for a in result.alternatives] == [False, True]
    assert result.verdict().startswith("request gpu: subrequest gpu/l4 can be satisfied")
    assert "is not allocated, but each request has enough devices" in report.verdict
    # With one L4 taken, count 2 of L4 fails too.
    taken = [claim("t", "x", allocated=[("gpu", "gpu-3")])]
    report = run_explain(target, slices=[mixed_node()], claims=taken)
    assert not report.requests[0].satisfied
    assert "no firstAvailable subrequest can be satisfied" in report.verdict
    assert "request gpu/l4: 1 of 4 devices pass (needs 2)" in report.verdict


def test_match_attribute_lists_the_values_every_request_can_meet() -> None:
    product = f"{DRIVER}/productName"
    same = {"matchAttribute": product}
    target = claim(
        "ns", "pair", [exactly("a", "gpu.nvidia.com", A100), exactly("b")], constraints=[same]
    )
    report = run_explain(target, slices=[mixed_node()])
    (constraint,) = report.constraints
    assert constraint.satisfiable
    assert constraint.values['"NVIDIA A100 80GB PCIe"'] == {"a": 2, "b": 2}
    assert constraint.values['"NVIDIA L4"'] == {"b": 2}
    assert constraint.note == 'values every request can meet: "NVIDIA A100 80GB PCIe"'
    # Requests that can only meet on different products cannot be allocated together.
    apart = claim(
        "ns",
        "apart",
        [exactly("a", "gpu.nvidia.com", A100), exactly("b", "gpu.nvidia.com", L4)],
        constraints=[same],
    )
    report = run_explain(apart, slices=[mixed_node()])
    assert not report.constraints[0].satisfiable
    assert f"matchAttribute {product}: no single value" in report.verdict
    assert report.to_json()["constraints"][0]["satisfiable"] is False


def test_match_attribute_counts_per_node_values_and_distinct_attribute() -> None:
    target = claim(
        "ns",
        "two",
        [exactly("gpu", count=2)],
        constraints=[{"matchAttribute": f"{DRIVER}/productName", "requests": ["gpu"]}],
    )
    assert run_explain(target, slices=[mixed_node()]).constraints[0].satisfiable
    taken = [claim("t", "x", allocated=[("gpu", "gpu-0"), ("gpu", "gpu-2")])]
    report = run_explain(target, slices=[mixed_node()], claims=taken)
    assert report.requests[0].satisfied  # two GPUs are free ...
    assert not report.constraints[0].satisfiable  # ... but not two of one product
    distinct = claim(
        "ns", "d", [exactly("gpu", count=3)], constraints=[{"distinctAttribute": f"{DRIVER}/uuid"}]
    )
    (constraint,) = run_explain(distinct, slices=[mixed_node()]).constraints
    assert constraint.satisfiable
    assert constraint.note == "4 distinct values available for 3 devices"


def test_capacity_requests_and_consumed_capacity_of_shared_devices() -> None:
    shared = gpu("gpu-0", memory="10Gi", allowMultipleAllocations=True)
    shared["capacity"]["memory"]["requestPolicy"] = {
        "default": "1Gi",
        "validValues": ["2Gi", "4Gi"],
    }
    used = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "node-a",
        "device": "gpu-0",
        "shareID": "s",
        "consumedCapacity": {"memory": "8Gi"},
    }
    slices = [resource_slice("node-a", [shared, l4("gpu-1")])]
    holders = [claim("t", "x", results=[used])]
    wants = claim(
        "ns", "c", [exactly("gpu", capacity={"requests": {"memory": "3Gi"}})], results=None
    )
    report = run_explain(wants, slices=slices, claims=holders)
    capacity = step(report, "capacity")
    assert capacity.detail == "memory=3Gi"
    # gpu-0: 3Gi rounds up to 4Gi, 2Gi left; gpu-1 (not shared) has 23034Mi >= 3Gi.
    assert (capacity.entered, capacity.passed) == (2, 1)
    assert capacity.passing_by_pool == {"gpu.nvidia.com/node-a": 1}
    device = PoolDevice(DRIVER, "node-a", "node-a", shared)
    assert capacity_fits(device, {"memory": "2Gi"}) is None
    assert (
        capacity_fits(device, {"memory": "5Gi"})
        == "capacity memory: request outside the requestPolicy"
    )
    assert capacity_fits(device, {"cores": "1"}) == "no capacity cores"


def test_shared_counters_exclude_partitions_of_an_allocated_gpu() -> None:
    counters = [{"name": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}]

    def part(name: str, kind: str, memory: str) -> Obj:
        return gpu(
            name,
            kind=kind,
            consumesCounters=[
                {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": memory}}}
            ],
        )

    devices = [part("gpu-0", "gpu", "40Gi"), part("gpu-0-mig-0", "mig", "10Gi")]
    devices.append(part("gpu-0-mig-1", "mig", "10Gi"))
    slices = [resource_slice("node-a", devices, shared_counters=counters)]
    mig = claim("ns", "m", [exactly("mig", "mig.nvidia.com")])
    report = run_explain(mig, slices=slices)
    assert step(report, "counters").passed == 2
    whole = [claim("t", "whole", allocated=[("gpu", "gpu-0")])]
    report = run_explain(mig, slices=slices, claims=whole)
    counters_step = step(report, "counters")
    assert (counters_step.entered, counters_step.passed) == (2, 0)
    assert "2 rejected by counters" in report.verdict


def test_pools_show_generations_and_incomplete_pools() -> None:
    slices = [
        resource_slice("node-a", [l4("old")], generation=1),
        resource_slice("node-a", [l4("gpu-0")], generation=3, count=2),
        resource_slice("node-b", [a100("gpu-0")]),
    ]
    report = run_explain(claim("ns", "c"), slices=slices)
    pools = {p["pool"]: p for p in report.pools}
    assert pools["node-a"]["generation"] == 3
    assert pools["node-a"]["incomplete"]
    assert step(report, "class gpu.nvidia.com selector #0").entered == 2
    rendered = [b for b in render_explanation(report) if isinstance(b, str)]
    assert any(b.startswith("pool gpu.nvidia.com/node-a: generation 3") and "INCOMPLETE" in b
               for b in rendered)  # fmt: skip


def test_a_count_no_single_node_has() -> None:
    slices = [resource_slice("node-a", [l4("gpu-0")]), resource_slice("node-b", [l4("gpu-0")])]
    report = run_explain(claim("ns", "c", [exactly("gpu", count=2)]), slices=slices)
    assert not report.requests[0].satisfied
    assert "no single node has 2 of them" in report.verdict


# ---- the commands, with the cluster reads replaced ---------------------------------------------


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Obj]]:
    """What `list_resource_objects` / `read_resource_claim` return; tests fill it. Kueue's API
    is not served (tests/cli/test_explain_kueue.py has it)."""
    objects: dict[str, list[Obj]] = {
        "deviceclasses": standard_classes(),
        "resourceslices": [mixed_node()],
        "resourceclaims": [],
    }

    def read(client: object, namespace: str, name: str) -> Obj:
        for item in objects["resourceclaims"]:
            if item["metadata"] == {**item["metadata"], "namespace": namespace, "name": name}:
                return item
        raise NotFoundError(f"read ResourceClaim {namespace}/{name}: 404 NotFound", status=404)

    monkeypatch.setattr(cli_cluster, "new_api_client", lambda path: object())
    monkeypatch.setattr(
        cli_cluster, "list_resource_objects", lambda client, plural: objects[plural]
    )
    monkeypatch.setattr(cli_cluster, "read_resource_claim", read)

    def no_kueue(client: object, api_version: str, plural: str, namespace: str) -> list[Obj]:
        raise NotFoundError(f"list {plural}: 404 NotFound", status=404)

    monkeypatch.setattr(cli_cluster, "list_namespaced_objects", no_kueue)
    FakeCoreV1.pods, FakeCoreV1.events, FakeCoreV1.quotas = [], [], []
    monkeypatch.setattr(cli_cluster, "CoreV1Api", FakeCoreV1)
    return objects


def test_explain_command_prints_the_verdict_first_and_fails_when_unallocatable(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaims"] = [
        claim("ns", "future", [exactly("gpu", "gpu.nvidia.com", FUTURE_DRIVER)]),
        claim("ns", "fine"),
    ]
    code = main(["explain", "ns/future", "--kubeconfig", "/dev/null"], environ={})
    out = capsys.readouterr().out
    assert code == EXIT_FAILED
    assert out.splitlines()[0].startswith("verdict: claim ns/future cannot be allocated now")
    assert "request selector #0" in out
    code = main(["explain", "ns/fine", "-o", "json"], environ={"KUBECONFIG": "/dev/null"})
    data = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    assert data["requests"][0]["alternatives"][0]["funnel"][0]["pass"] == 4


def test_explain_command_errors(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", "no-slash"], environ={}) == EXIT_USAGE
    assert "expected NAMESPACE/CLAIM" in capsys.readouterr().err
    assert main(["explain", "ns/missing"], environ={}) == EXIT_FAILED
    assert "gpu-dra explain: error: read ResourceClaim ns/missing: 404" in capsys.readouterr().err


def test_inventory_command_tables_and_json(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaims"] = [claim("ns", "a", allocated=[("gpu", "gpu-2")])]
    assert main(["inventory"], environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert "gpu: 3/4 free" in out
    assert "ns/a (gpu)" not in out  # the summary: no device rows by default
    assert "gpu-dra inventory --devices" in out
    assert main(["inventory", "--devices"], environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert "ns/a (gpu)" in out
    assert "gpu: 3/4 free" in out
    assert main(["inventory", "-o", "json"], environ={}) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["nodes"]["node-a"] == {
        "devices": 4,
        "free": 3,
        "allocated": 1,
        "shared": 0,
        "blocked": 0,
        "types": {"gpu": {"devices": 4, "free": 3}},
    }
    assert {c["name"]: (c["total"], c["free"]) for c in data["classes"]} == {
        "gpu.nvidia.com": (4, 3),
        "mig.nvidia.com": (0, 0),
    }


def test_every_class_selector_is_a_step_of_its_own() -> None:
    classes = [
        device_class(
            "big",
            "device.driver == 'gpu.nvidia.com'",
            f"device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) >= 0",
        )
    ]
    target = claim("ns", "c", [exactly("gpu", "big")])
    report = explain(target, classes, [mixed_node()], [target])
    alternative = report.requests[0].alternatives[0]
    assert alternative.class_selectors[0] == "device.driver == 'gpu.nvidia.com'"
    assert [(s.name, s.passed) for s in alternative.steps[:2]] == [
        ("class big selector #0", 4),
        ("class big selector #1", 2),
    ]
    assert "2 rejected by class big selector #1" in alternative.verdict()


# ---- device taints and tolerations (resource-api.md §5.3) --------------------------------------
UNHEALTHY = {"key": "gpu.nvidia.com/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
MAINTENANCE = {"key": "example.com/maintenance", "effect": "NoExecute"}


def tainted_node() -> Obj:
    """gpu-0: unhealthy (NoSchedule), gpu-1: maintenance (NoExecute), gpu-2: an informational
    taint (effect None), gpu-3: untainted."""
    return resource_slice(
        "node-a",
        [
            gpu("gpu-0", taints=[UNHEALTHY]),
            gpu("gpu-1", taints=[MAINTENANCE]),
            gpu("gpu-2", taints=[{"key": "example.com/note", "effect": "None"}]),
            gpu("gpu-3"),
        ],
    )


def test_untolerated_taints_exclude_devices_and_name_the_taint_keys() -> None:
    target = claim("ns", "any", [exactly("gpu", "gpu.nvidia.com", count=3)])
    report = run_explain(target, slices=[tainted_node()])
    taint_step = step(report, "not tainted")
    assert (taint_step.entered, taint_step.passed, taint_step.rejected) == (4, 2, 2)
    assert taint_step.taints == [
        "gpu.nvidia.com/unhealthy=xid-79:NoSchedule",
        "example.com/maintenance:NoExecute",
    ]
    assert taint_step.detail == "no tolerations"
    assert report.requests[0].alternatives[0].candidates[0].name == "gpu-2"
    assert not report.requests[0].satisfied
    assert (
        "2 excluded by taint (gpu.nvidia.com/unhealthy=xid-79:NoSchedule, "
        "example.com/maintenance:NoExecute)" in report.verdict
    )
    assert report.to_json()["requests"][0]["alternatives"][0]["funnel"][1]["taints"] == [
        "gpu.nvidia.com/unhealthy=xid-79:NoSchedule",
        "example.com/maintenance:NoExecute",
    ]


@pytest.mark.parametrize(
    ("tolerations", "tolerated"),
    [
        ([{"key": "gpu.nvidia.com/unhealthy", "operator": "Exists"}], {"gpu-0"}),
        ([{"key": "gpu.nvidia.com/unhealthy", "value": "xid-79"}], {"gpu-0"}),
        ([{"key": "gpu.nvidia.com/unhealthy", "value": "xid-48"}], set()),
        ([{"key": "gpu.nvidia.com/unhealthy", "operator": "Exists", "effect": "NoExecute"}], set()),
        ([{"operator": "Exists"}], {"gpu-0", "gpu-1"}),
        ([{"operator": "Exists", "effect": "NoExecute"}], {"gpu-1"}),
        (
            [
                {"key": "example.com/maintenance", "operator": "Exists", "tolerationSeconds": 60},
                {"key": "gpu.nvidia.com/unhealthy", "operator": "Equal", "value": "xid-79"},
            ],
            {"gpu-0", "gpu-1"},
        ),
    ],
)
def test_tolerations_let_tainted_devices_through(
    tolerations: list[Obj], tolerated: set[str]
) -> None:
    target = claim("ns", "t", [exactly("gpu", "gpu.nvidia.com", tolerations=tolerations)])
    report = run_explain(target, slices=[tainted_node()])
    passing = {d.name for d in report.requests[0].alternatives[0].candidates}
    assert passing == {"gpu-2", "gpu-3"} | tolerated
    taint_step = step(report, "not tainted")
    assert taint_step.detail.startswith("tolerations: ")
    assert taint_step.rejected == 2 - len(tolerated)


def test_first_available_subrequests_have_their_own_tolerations() -> None:
    tolerant = {
        "name": "tolerant",
        "deviceClassName": "gpu.nvidia.com",
        "count": 3,
        "tolerations": [{"operator": "Exists"}],
    }
    strict = {"name": "strict", "deviceClassName": "gpu.nvidia.com", "count": 3}
    target = claim("ns", "fa", [{"name": "gpu", "firstAvailable": [strict, tolerant]}])
    report = run_explain(target, slices=[tainted_node()])
    strict_report, tolerant_report = report.requests[0].alternatives
    assert not strict_report.satisfied
    assert tolerant_report.satisfied
    assert report.requests[0].satisfied


def test_no_taint_step_when_no_device_is_tainted() -> None:
    target = claim("ns", "plain", [exactly("gpu", "gpu.nvidia.com")])
    report = run_explain(target, slices=[mixed_node()])
    assert all(s.name != "not tainted" for s in report.requests[0].alternatives[0].steps)


def test_selectors_run_once_per_group_of_alike_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = Selector.matches

    def counted(self: Selector, device: Any) -> bool:
        calls.append(device.name)
        return original(self, device)

    monkeypatch.setattr(Selector, "matches", counted)
    many = resource_slice("node-a", [l4(f"gpu-{i}") for i in range(100)] + [a100("gpu-100")])
    target = claim("ns", "l4", [exactly("gpu", "gpu.nvidia.com", L4, count=100)])
    report = run_explain(target, slices=[many])
    selector_step = step(report, "request selector #0")
    assert (selector_step.entered, selector_step.passed, selector_step.rejected) == (101, 100, 1)
    assert report.requests[0].satisfied
    assert len(calls) <= 4  # class selector and request selector, an L4 and the A100 each


def offered_h100(name: str, replicas: int = 4) -> Obj:
    """An H100 as the kubelet plugin publishes it when offered as MPS shares."""
    model = h100()
    return {**offered_device(gpu_device(model), model, replicas=replicas), "name": name}


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        ({"memory": "8Gi"}, ["names no compute: gets 25 of 100 (1/4 of the device)"]),
        ({"compute": "50"}, ["names no memory: gets 20389Mi of 81559Mi (1/4 of the device)"]),
        (
            {},
            [
                "names no compute: gets 25 of 100 (1/4 of the device)",
                "names no memory: gets 20389Mi of 81559Mi (1/4 of the device)",
            ],
        ),
        ({"memory": "8Gi", "compute": "10"}, []),
    ],
)
def test_explain_says_what_a_share_gets_for_the_amounts_it_does_not_name(
    requests: dict[str, str], expected: list[str]
) -> None:
    shares_class = device_class("mps.gpu.nvidia.com", "device.allowMultipleAllocations")
    slices = [resource_slice("node-a", [offered_h100("gpu-0")])]
    spec = {"capacity": {"requests": requests}} if requests else {}
    target = claim("ns", "share", [exactly("share", "mps.gpu.nvidia.com", **spec)])

    report = explain(target, [shares_class], slices, [target])

    capacity = step(report, "capacity")
    replicas_note = (
        "the parts of gpu.nvidia.com devices are set by the node's --mps-share-replicas "
        "(docs/mps.md, 'Offering GPUs as shares')"
    )
    assert capacity.defaults == ([*expected, replicas_note] if expected else [])
    assert capacity.passed == 1
    lines = [b for b in render_explanation(report) if isinstance(b, str)]
    for note in expected:
        assert f"  {note}" in lines
    assert json.loads(json.dumps(capacity.to_json()))["defaults"] == capacity.defaults


def test_explain_says_when_an_unnamed_amount_is_the_whole_device() -> None:
    shares_class = device_class("mps.gpu.nvidia.com", "device.allowMultipleAllocations")
    slices = [resource_slice("node-a", [offered_h100("gpu-0", replicas=1)])]
    target = claim("ns", "share", [exactly("share", "mps.gpu.nvidia.com")])

    capacity = step(explain(target, [shares_class], slices, [target]), "capacity")

    assert capacity.defaults[0] == "names no compute: gets 100 of 100 (all of the device)"
