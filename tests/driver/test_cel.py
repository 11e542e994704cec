"""driver.cel: DRA selectors evaluated as the Kubernetes scheduler evaluates them.

The table pairs an expression with a device and the scheduler's outcome: match, no match,
runtime error (allocation aborts) or compile error (the apiserver rejects the object). Expected
results follow resource-api.md §8 and cel-engines.md §2 and §5.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import yaml

from gpu_dra.driver.attributes import gpu_device, published_devices
from gpu_dra.driver.cel import (
    MAX_EXPRESSION_LENGTH,
    CelCompileError,
    CelRuntimeError,
    DraDevice,
    Quantity,
    Selector,
    Semver,
    compile_selector,
    to_cel_device,
)
from gpu_dra.driver.cel import engine_cel_expr_python as engine
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import Device
from gpu_dra.driver.shares import MigShareSelection, shared_device_name, with_shares

DRIVER = "gpu.nvidia.com"
DEVICECLASSES = Path(__file__).resolve().parents[2] / "deviceclasses"
G = "device.attributes['gpu.nvidia.com']"
C = "device.capacity['gpu.nvidia.com']"


@cache
def profile_devices(profile: str) -> tuple[Device, ...]:
    host = SimulatedHost.load(profile, "node-a")
    return tuple(gpu_device(gpu) for gpu in discover_gpus(host.nvml, host.pci))


def mig_device() -> Device:
    """A MIG device as NVIDIA's driver publishes one (gpu-dra publishes none yet)."""
    return {
        "name": "gpu-0-mig-1g5gb-0",
        "attributes": {
            "type": {"string": "mig"},
            "profile": {"string": "1g.5gb"},
            "parentUUID": {"string": "GPU-ac516e8a-823f-5053-b24a-22959069fc84"},
            "productName": {"string": "NVIDIA A100-SXM4-40GB"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "580.65.6"},
        },
        "capacity": {"memory": {"value": "4864Mi"}, "multiprocessors": {"value": "14"}},
    }


def device(kind: str) -> DraDevice:
    """Fresh devices by nickname: the first GPU of a simulated profile, or a hand-made one."""
    if kind == "mig":
        return to_cel_device(DRIVER, mig_device())
    if kind == "channel":
        channel: Device = {
            "name": "channel-0",
            "attributes": {"type": {"string": "channel"}, "id": {"int": 0}},
            "allowMultipleAllocations": True,
        }
        return to_cel_device("compute-domain.nvidia.com", channel)
    profile = {"h100": "hgx-h100", "a100": "dgx-a100", "l4": "l4x4", "t4": "t4"}[kind]
    return to_cel_device(DRIVER, profile_devices(profile)[0])


def test_the_wrappers_message_types_are_not_user_visible():
    # The conformance table (tests/cel_conformance.py) covers the language; this is the wrapper's.
    with pytest.raises(CelCompileError, match="undeclared reference to 'kubernetes'"):
        compile_selector(f"{C}.memory == kubernetes.Quantity{{num: '1/1'}}")


# ---- the shipped DeviceClasses against the simulated machines ---------------------------------
def device_classes() -> dict[str, list[str]]:
    classes = {}
    for path in sorted(DEVICECLASSES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                classes[doc["metadata"]["name"]] = [
                    s["cel"]["expression"] for s in doc["spec"]["selectors"]
                ]
    return classes


def selected_products(class_name: str) -> set[str]:
    """Product names of the simulated GPUs (all built-in profiles) that the class selects."""
    selectors = [compile_selector(text) for text in device_classes()[class_name]]
    products = set()
    for profile in ("hgx-h100", "dgx-a100", "l4x4", "t4", "mixed"):
        for published in profile_devices(profile):
            dra_device = to_cel_device(DRIVER, published)
            if all(selector.matches(dra_device) for selector in selectors):
                products.add(published["attributes"]["productName"]["string"])
    return products


H100 = "NVIDIA H100 80GB HBM3"
A100 = {"NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"}
ALL_GPUS = {H100, *A100, "NVIDIA L4", "Tesla T4"}


@pytest.mark.parametrize(
    ("class_name", "expected"),
    [
        ("gpu.nvidia.com", ALL_GPUS),
        ("large-memory.gpu.nvidia.com", {H100, *A100}),
        ("hopper.gpu.nvidia.com", {H100}),
        ("training.gpu.nvidia.com", {H100, *A100}),
        ("mig.nvidia.com", set()),
        ("mps.gpu.nvidia.com", set()),  # no GPU is offered as MPS shares by default
        ("capped.gpu.nvidia.com", set()),  # nor as capped shares
        ("mps.mig.nvidia.com", set()),  # nor MIG device
        # MIG families: no MIG devices without static MIG or --dynamic-mig (test_partitions.py)
        *((f"mig-{family}.gpu.nvidia.com", set()) for family in ("1g", "2g", "3g", "4g", "7g")),
    ],
)
def test_device_class_selects_the_expected_simulated_gpus(class_name, expected):
    assert selected_products(class_name) == expected


def test_every_shipped_device_class_is_tested_and_compiles():
    classes = device_classes()
    assert set(classes) == {
        "gpu.nvidia.com",
        "large-memory.gpu.nvidia.com",
        "hopper.gpu.nvidia.com",
        "training.gpu.nvidia.com",
        "mig.nvidia.com",
        "mps.gpu.nvidia.com",
        "capped.gpu.nvidia.com",
        "mps.mig.nvidia.com",
        *(f"mig-{family}.gpu.nvidia.com" for family in ("1g", "2g", "3g", "4g", "7g")),
    }
    for expressions in classes.values():
        for text in expressions:
            compile_selector(text)


def test_mig_class_selects_a_mig_device_and_gpu_class_does_not():
    mig = device("mig")
    assert all(compile_selector(t).matches(mig) for t in device_classes()["mig.nvidia.com"])
    assert not any(compile_selector(t).matches(mig) for t in device_classes()["gpu.nvidia.com"])


# ---- claim-side selectors users copy from NVIDIA's demos and docs (nvidia-compat.md §1) --------
NVIDIA_CLAIM_SELECTORS = [
    ("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'", {"mig": True}),
    (
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
        {"a100": True, "h100": False, "mig": True},
    ),
    ("device.attributes['gpu.nvidia.com'].architecture == 'Hopper'", {"h100": True, "a100": False}),
    (
        'device.attributes["gpu.nvidia.com"].driverVersion.compareTo(semver("570.0.0")) >= 0',
        {"h100": True, "l4": True, "t4": False},  # T4 profile: driver 535.247.1
    ),
    (
        'device.attributes["gpu.nvidia.com"].uuid == "GPU-201623eb-f3c3-543b-933d-26aaf4c600ef"',
        {"h100": True, "a100": False},
    ),
    (
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity(\"40Gi\"))",
        {"h100": True, "a100": True, "l4": False, "mig": False},
    ),
    (
        'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("80Gi")) >= 0',
        {"a100": True, "h100": False},
    ),
    (
        "device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity(\"10\")) && "
        "device.capacity['gpu.nvidia.com'].multiprocessors.isLessThan(quantity(\"30\"))",
        {"mig": True},
    ),
]


@pytest.mark.parametrize(("expression", "expected"), NVIDIA_CLAIM_SELECTORS)
def test_nvidia_claim_selector(expression, expected):
    selector = compile_selector(expression)
    assert {kind: selector.matches(device(kind)) for kind in expected} == expected


def test_nvidia_mig_profile_selector_is_a_runtime_error_on_whole_gpus():
    # Copied without a has() guard it aborts allocation wherever a whole GPU is seen first.
    with pytest.raises(CelRuntimeError, match="no such key: profile"):
        compile_selector(NVIDIA_CLAIM_SELECTORS[0][0]).matches(device("h100"))


# ---- building `device` --------------------------------------------------------------------------
def test_device_groups_attributes_by_domain_and_converts_values():
    dra_device = to_cel_device(DRIVER, profile_devices("hgx-h100")[0])
    assert dra_device.driver == DRIVER
    assert set(dra_device.attributes) == {DRIVER, "resource.kubernetes.io"}
    assert dra_device.attributes["resource.kubernetes.io"] == {
        "pciBusID": "0000:1b:00.0",
        "pcieRoot": "pci0000:18",
        "numaNode": 0,
    }
    assert dra_device.attributes[DRIVER]["driverVersion"] == Semver(580, 95, 5)
    assert dra_device.capacity == {DRIVER: {"memory": Quantity.parse("81559Mi")}}
    assert dra_device.allow_multiple_allocations is False
    assert dra_device.name == "gpu-0"


def test_bare_names_go_to_the_driver_domain_of_any_driver():
    published: Device = {
        "name": "d",
        "attributes": {"model": {"string": "x"}, "a.io/b": {"bool": True}},
    }
    assert to_cel_device("dra.example.com", published).attributes == {
        "dra.example.com": {"model": "x"},
        "a.io": {"b": True},
    }


@pytest.mark.parametrize(
    ("published", "message"),
    [
        ({"name": "d", "attributes": {"v": {"version": "1.0"}}}, "device d: attribute v"),
        ({"name": "d", "capacity": {"memory": {"value": "80 Gi"}}}, "device d: capacity memory"),
        ({"name": "d", "attributes": {"v": {}}}, "attribute v has no value"),
    ],
)
def test_unconvertible_device_is_a_runtime_error(published, message):
    with pytest.raises(CelRuntimeError, match=message):
        to_cel_device(DRIVER, published)


# ---- limits and compile-once --------------------------------------------------------------------
def test_expression_length_limit_counts_bytes():
    at_limit = "'" + "x" * (MAX_EXPRESSION_LENGTH - 9) + "' == 'y'"
    assert len(at_limit.encode()) == MAX_EXPRESSION_LENGTH
    assert not compile_selector(at_limit).matches(device("h100"))
    one_more_byte = at_limit.replace("x", "é", 1)  # same characters, one byte more
    with pytest.raises(CelCompileError, match="10241 bytes long, may not be more than 10240"):
        compile_selector(one_more_byte)


def test_selector_evaluates_many_devices_without_recompiling(monkeypatch):
    selector = compile_selector(f"{C}.memory.compareTo(quantity('40Gi')) >= 0")

    def no_compiling(*args: object) -> None:
        raise AssertionError("compiled during evaluation")

    monkeypatch.setattr(engine._Environment, "compile", no_compiling)
    devices = [device(kind) for kind in ("h100", "a100", "l4", "t4")] * 50
    assert sum(selector.matches(d) for d in devices) == 100


def test_a_device_is_converted_once_for_all_selectors():
    dra_device = device("h100")
    first, second = compile_selector("device.driver != ''"), compile_selector("true")
    assert first.matches(dra_device)
    cached = dict(dra_device.engine_cache)
    assert second.matches(dra_device)
    assert dra_device.engine_cache == cached
    assert len(cached) == 1


@pytest.mark.parametrize("class_name", sorted(device_classes()))
def test_shipped_device_classes_run_without_python_callbacks(class_name):
    # cel-expr-python 0.1.3 leaks memory on every call into Python (docs/cel.md); the catalog's
    # quantity/semver comparisons with literals are compiled to native CEL instead.
    for text in device_classes()[class_name]:
        runs = engine.compile_program(text).runs
        for call in ("compareTo", "isGreaterThan", "isLessThan", "quantity(", "semver("):
            assert call not in runs


@pytest.mark.parametrize(
    "capacity", ["0", "1", "1500m", "1.5", "0.999999999", "1.000000001", "80Gi", "81559Mi", "7Ei"]
)
@pytest.mark.parametrize("literal", ["0", "1", "1.5", "1001m", "1.000000001", "80Gi", "7.5Ei"])
def test_native_quantity_comparison_agrees_with_the_library(capacity, literal):
    published: Device = {"name": "d", "capacity": {"x": {"value": capacity}}}
    dra_device = to_cel_device(DRIVER, published)
    expected = Quantity.parse(capacity).compare(Quantity.parse(literal))
    native = f"{C}.x.compareTo(quantity('{literal}'))"
    callback = f"cel.bind(l, quantity('{literal}'), {C}.x.compareTo(l))"
    for method, holds in (("isGreaterThan", expected > 0), ("isLessThan", expected < 0)):
        assert (
            compile_selector(f"{C}.x.{method}(quantity('{literal}'))").matches(dra_device) is holds
        )
    assert compile_selector(f"{native} == {expected}").matches(dra_device)
    assert compile_selector(f"{callback} == {expected}").matches(dra_device)


@pytest.mark.parametrize(
    "version", ["1.0.0", "1.0.0-rc.1", "1.0.1-alpha", "0.9.9", "2.0.0", "1.1.0"]
)
@pytest.mark.parametrize("literal", ["1.0.0", "1.0.1", "0.10.0", "1.0.0-rc.2"])
def test_native_semver_comparison_agrees_with_the_library(version, literal):
    published: Device = {"name": "d", "attributes": {"v": {"version": version}}}
    dra_device = to_cel_device(DRIVER, published)
    expected = Semver.parse(version).compare(Semver.parse(literal))
    assert compile_selector(f"{G}.v.compareTo(semver('{literal}')) == {expected}").matches(
        dra_device
    )
    greater = compile_selector(f"{G}.v.isGreaterThan(semver('{literal}'))")
    assert greater.matches(dra_device) is (expected > 0)
    less = compile_selector(f"cel.bind(g, {G}, g.v.isLessThan(semver('{literal}')))")
    assert less.matches(dra_device) is (expected < 0)


def test_native_comparison_keeps_runtime_errors():
    h100 = device("h100")
    with pytest.raises(CelRuntimeError, match="no such key: nope"):
        compile_selector(f"{C}.nope.compareTo(quantity('1')) > 0").matches(h100)
    with pytest.raises(CelRuntimeError):  # a version compared with a quantity
        compile_selector(f"{G}.driverVersion.isGreaterThan(quantity('1'))").matches(h100)


def test_iteration_budget_is_a_runtime_error():
    # cel-cpp's fixed 10,000-iteration budget (Kubernetes allows cost 1,000,000): documented gap.
    hundred = "[" + ", ".join(["0"] * 100) + "]"
    selector = compile_selector(f"{hundred}.all(x, {hundred}.all(y, x == y))")
    with pytest.raises(CelRuntimeError, match="iteration budget"):
        selector.matches(device("h100"))


def test_mps_class_selects_exactly_the_gpus_offered_as_shares():
    selectors = [compile_selector(text) for text in device_classes()["mps.gpu.nvidia.com"]]
    host = SimulatedHost.load("mixed", "node-a")
    gpus = discover_gpus(host.nvml, host.pci)
    devices = with_shares([gpu_device(gpu) for gpu in gpus], gpus[1:3])
    selected = [
        device["name"]
        for device in devices
        if all(selector.matches(to_cel_device(DRIVER, device)) for selector in selectors)
    ]
    assert selected == [gpu_device(gpu)["name"] for gpu in gpus[1:3]]


def test_capped_and_mps_classes_select_only_their_own_offered_gpus():
    host = SimulatedHost.load("mixed", "node-a")
    gpus = discover_gpus(host.nvml, host.pci)
    devices = with_shares([gpu_device(gpu) for gpu in gpus], gpus[:1], gpus[1:3])

    def selected(class_name: str) -> list[str]:
        selectors = [compile_selector(text) for text in device_classes()[class_name]]
        return [
            device["name"]
            for device in devices
            if all(selector.matches(to_cel_device(DRIVER, device)) for selector in selectors)
        ]

    assert selected("capped.gpu.nvidia.com") == [gpu_device(gpu)["name"] for gpu in gpus[1:3]]
    assert selected("mps.gpu.nvidia.com") == [gpu_device(gpus[0])["name"]]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        (
            "device.attributes['memory'] >= 40000",
            "ERROR: <input>:1:29: found no matching overload for '_>=_' applied to "
            "'(map(string, any), int)'",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory + 1 > 2",
            "ERROR: <input>:1:42: found no matching overload for '_+_' applied to "
            "'(kubernetes.Quantity, int)'",
        ),
        (
            "device.attributes['gpu.nvidia.com'].x + device.capacity['gpu.nvidia.com'].m > 1",
            "ERROR: <input>:1:39: found no matching overload for '_+_' applied to "
            "'(any, kubernetes.Quantity)'",
        ),
        (  # a member call, in cel-go's words: target.(arguments)
            "device.capacity['memory'].compareTo(quantity('40Gi')) >= 0",
            "ERROR: <input>:1:36: found no matching overload for 'compareTo' applied to "
            "'map(string, kubernetes.Quantity).(kubernetes.Quantity)'",
        ),
        (
            "quantity('1').compareTo(semver('1.0.0')) == 0",
            "ERROR: <input>:1:24: found no matching overload for 'compareTo' applied to "
            "'kubernetes.Quantity.(kubernetes.Semver)'",
        ),
        ("device.driver + '-x'", "must evaluate to bool or the unknown type, not string"),
        (
            "device.attributes",
            "must evaluate to bool or the unknown type, not map(string, map(string, any))",
        ),
    ],
)
def test_device_fields_are_typed_as_the_apiserver_types_them(expression, message):
    with pytest.raises(CelCompileError) as raised:
        compile_selector(expression)
    lines = str(raised.value).splitlines()
    assert lines[0] == message
    if len(lines) > 1:  # the excerpt shows what the user wrote, not the renamed text
        assert lines[1] == f" | {expression}"


@pytest.mark.parametrize(
    "expression",
    [
        "has(device.driver) && device.attributes['gpu.nvidia.com'].productName != ''",
        "device.attributes['gpu.nvidia.com'].?mig.orValue(false) == false",
        "cel.bind(g, device.attributes['gpu.nvidia.com'], g.index >= 0)",
        "device.attributes.exists(d, device.attributes[d].size() > 0)",
        "device.capacity['gpu.nvidia.com'].memory == quantity('80Gi')",
        "[1].all(device, device == 1)",
    ],
)
def test_well_typed_selectors_still_compile(expression):
    compile_selector(expression)


WHOLE_GPU_CLASSES = (
    "gpu.nvidia.com",
    "large-memory.gpu.nvidia.com",
    "hopper.gpu.nvidia.com",
    "training.gpu.nvidia.com",
)
WHOLE_MIG_CLASSES = (
    "mig.nvidia.com",
    *(f"mig-{family}.gpu.nvidia.com" for family in ("1g", "2g", "3g", "4g", "7g")),
)


def selected_names(class_name: str, devices: list[Device]) -> list[str]:
    selectors = [compile_selector(text) for text in device_classes()[class_name]]
    return [
        device["name"]
        for device in devices
        if all(selector.matches(to_cel_device(DRIVER, device)) for selector in selectors)
    ]


@pytest.mark.parametrize("class_name", WHOLE_GPU_CLASSES)
def test_whole_gpu_classes_never_select_a_gpu_offered_as_shares(class_name):
    # Offered GPUs are share-only (docs/deviceclasses.md): an amount-less claim of a whole-GPU
    # class must not take a quarter of a shared GPU, nor a share the whole of it.
    host = SimulatedHost.load("hgx-h100", "node-a")
    gpus = discover_gpus(host.nvml, host.pci)
    plain = [gpu_device(gpu) for gpu in gpus]
    devices = with_shares(plain, gpus[:2], gpus[2:4])  # 0, 1 MPS; 2, 3 capped
    assert selected_names(class_name, devices) == [d["name"] for d in plain[4:]]
    # The shares classes select exactly the offered ones: the tiers are disjoint.
    assert selected_names("mps.gpu.nvidia.com", devices) == [d["name"] for d in plain[:2]]
    assert selected_names("capped.gpu.nvidia.com", devices) == [d["name"] for d in plain[2:4]]


@pytest.mark.parametrize("class_name", WHOLE_MIG_CLASSES)
def test_mig_classes_never_select_a_mig_device_offered_as_shares(class_name):
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    found = discover_devices(host.nvml, host.pci)
    plain = published_devices(found.gpus, found.mig_devices)
    offered = MigShareSelection.parse("all").select(found.mig_devices)
    assert offered
    before = selected_names(class_name, plain)
    assert before or class_name != "mig.nvidia.com"
    assert selected_names(class_name, with_shares(plain, offered)) == []
    assert set(selected_names("mps.mig.nvidia.com", with_shares(plain, offered))) >= set(before)


def test_mps_mig_class_selects_exactly_the_mig_devices_offered_as_shares():
    selectors = [compile_selector(text) for text in device_classes()["mps.mig.nvidia.com"]]
    gpu_class = [compile_selector(text) for text in device_classes()["mps.gpu.nvidia.com"]]
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    found = discover_devices(host.nvml, host.pci)
    offered = MigShareSelection.parse("3g.40gb").select(found.mig_devices)
    devices = with_shares(published_devices(found.gpus, found.mig_devices), offered)

    def chosen(by: list[Selector]) -> list[str]:
        return [
            device["name"]
            for device in devices
            if all(selector.matches(to_cel_device(DRIVER, device)) for selector in by)
        ]

    assert chosen(selectors) == [shared_device_name(mig) for mig in offered]
    assert len(offered) == 3
    assert chosen(gpu_class) == []  # the GPU shares class never selects a MIG device
