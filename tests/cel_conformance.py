"""The CEL conformance table: selector expression x device -> the Kubernetes outcome.

One table for two checks:

- ``tests/driver/test_cel_conformance.py`` evaluates every case with ``gpu_dra.driver.cel``;
- ``e2e/test_cel_conformance.py`` asks the real apiserver (compile errors: a DeviceClass with the
  selector is rejected, the others are accepted) and the real scheduler (one claim + pod per case
  over ResourceSlices holding `DEVICES`): match -> allocated to the case's device, no match ->
  "cannot allocate all claims", runtime error -> the scheduler's "CEL runtime error".

`Case.expected` and `Case.message` are the cluster's answer (Kubernetes v1.37.1, the e2e
cluster); where gpu-dra knowingly differs (docs/cel.md, "Differences from Kubernetes"),
`Case.python` records what the Python layer gives instead and the unit test checks that, so a
difference that goes away (or appears) fails a test.

The devices are the simulated GPUs as the kubelet plugin publishes them (`published_devices`),
re-homed for the e2e: they are published by `TEST_DRIVER` (so gpu-dra's plugin is not involved)
with every name of NVIDIA's domain written out (``productName`` -> ``gpu.nvidia.com/productName``),
which gives the selector exactly the ``device.attributes['gpu.nvidia.com']`` of production.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Final, Literal

from gpu_dra.driver.attributes import published_devices
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import Device

TEST_DRIVER: Final = "conformance.gpu-dra.test"
OTHER_DRIVER: Final = "other.gpu-dra.test"
NVIDIA: Final = "gpu.nvidia.com"

Outcome = Literal["match", "no match", "runtime error", "compile error"]
MATCH: Final = "match"
NO_MATCH: Final = "no match"
RUNTIME: Final = "runtime error"
COMPILE: Final = "compile error"


@dataclass(frozen=True)
class Case:
    expression: str
    device: str
    """A key of `DEVICES`."""
    expected: Outcome
    message: str = ""
    """For errors: a fragment of the cluster's message (the scheduler's event or the
    apiserver's rejection)."""
    python: tuple[Outcome, str] | None = None
    """Where gpu-dra knowingly differs: its outcome and a fragment of its message."""


def _rehomed(driver: str, device: Device) -> tuple[str, Device]:
    """`device` of NVIDIA's driver as `TEST_DRIVER` publishes it: names fully qualified."""

    def qualified(name: str) -> str:
        return name if "/" in name else f"{driver}/{name}"

    copy: Device = {"name": device["name"]}
    copy["attributes"] = {qualified(k): v for k, v in device.get("attributes", {}).items()}
    if "capacity" in device:
        copy["capacity"] = {qualified(k): v for k, v in device["capacity"].items()}
    return TEST_DRIVER, copy


@cache
def _first_published(profile: str) -> Device:
    host = SimulatedHost.load(profile, "node-a")
    found = discover_devices(host.nvml, host.pci)
    return published_devices(found.gpus, found.mig_devices)[0]


def devices() -> dict[str, tuple[str, Device]]:
    """(driver, published device) by nickname. h100: "NVIDIA H100 80GB HBM3", 81559Mi, cc 9.0.0,
    driver 580.95.5, NUMA node 0, PCI bus 0000:1b:00.0; mig: its 1g.10gb (9984Mi, 16 SMs);
    channel: a device of another driver with bare (driver-domain) names, multi-allocatable."""
    found = {
        kind: _rehomed(NVIDIA, _first_published(profile))
        for kind, profile in (
            ("h100", "hgx-h100"),
            ("a100", "dgx-a100"),
            ("l4", "l4x4"),
            ("t4", "t4"),
            ("mig", "hgx-h100-mig"),
        )
    }
    channel: Device = {
        "name": "channel-0",
        "attributes": {"type": {"string": "channel"}, "id": {"int": 0}, "shared": {"bool": True}},
        "allowMultipleAllocations": True,
    }
    found["channel"] = (OTHER_DRIVER, channel)
    return found


G = "device.attributes['gpu.nvidia.com']"
C = "device.capacity['gpu.nvidia.com']"
STD = "device.attributes['resource.kubernetes.io']"
OTHER = f"device.attributes['{OTHER_DRIVER}']"
MISSING = "device.attributes['missing.example.com']"
_HUNDRED = "[" + ", ".join(["0"] * 100) + "]"
_THOUSAND = "[" + ",".join(["0"] * 1000) + "]"
_AT_LIMIT = "'" + "x" * (10 * 1024 - 9) + "' == 'y'"  # exactly 10240 bytes
_ITERATION_BUDGET = ("runtime error", "iteration budget of 10000 exceeded")

CASES: Final[tuple[Case, ...]] = (
    # ---- driver and type ------------------------------------------------------------------------
    Case(f"device.driver == '{TEST_DRIVER}'", "h100", MATCH),
    Case(f"device.driver == '{TEST_DRIVER}'", "channel", NO_MATCH),
    Case("device.driver.endsWith('.gpu-dra.test')", "channel", MATCH),
    Case(f"{G}.type == 'gpu'", "h100", MATCH),
    Case(f"{G}.type == 'gpu'", "mig", NO_MATCH),
    Case(f"{G}.type in ['gpu', 'vfio']", "a100", MATCH),
    Case("device.name == 'gpu-0'", "h100", COMPILE, "undefined field 'name'"),
    # ---- string attributes and the strings / regex extensions ----------------------------------
    Case(f"{G}.productName == 'NVIDIA H100 80GB HBM3'", "h100", MATCH),
    Case(f"{G}['productName'].startsWith('NVIDIA H')", "t4", NO_MATCH),
    Case(f"{G}.productName.lowerAscii().matches('^.*h100.*$')", "h100", MATCH),
    Case(f"{G}.productName.lowerAscii().contains('a100')", "h100", NO_MATCH),
    Case(f"{G}.uuid.matches('^GPU-[0-9a-f]{{8}}-')", "h100", MATCH),
    Case(f"{G}.productName.split(' ')[0] == 'NVIDIA'", "l4", MATCH),
    Case(f"{G}.productName.replace('NVIDIA ', '').startsWith('H100')", "h100", MATCH),
    Case(f"{G}.architecture.upperAscii() == 'HOPPER'", "h100", MATCH),
    Case(f"{G}.productName.substring(7, 11) == 'H100'", "h100", MATCH),
    Case(f"{G}.productName.indexOf('A100') == 7", "a100", MATCH),
    Case(f"['Hopper', 'Ampere'].exists(a, a == {G}.architecture)", "t4", NO_MATCH),
    Case(f"{G}.productName.size() <= 64", "h100", MATCH),
    Case("'xNVIDIA'.matches('NVIDIA')", "h100", MATCH),
    Case(f"{G}.productName == 'NVIDIA H100 80GB\\u0020HBM3'", "h100", MATCH),
    Case("'a1'.matches('\\d')", "h100", COMPILE, "Syntax error"),
    Case(
        f"{G}.productName.matches('[')",
        "h100",
        COMPILE,
        "invalid matches argument",
    ),
    # ---- int and bool attributes; CEL's numeric rules -------------------------------------------
    Case(f"{STD}.numaNode == 0 && {STD}.pcieRoot.startsWith('pci')", "h100", MATCH),
    Case(f"{STD}.numaNode == 0u && {STD}.numaNode < 0.5", "h100", MATCH),
    Case(f"{STD}.numaNode == '0'", "h100", NO_MATCH),
    Case(f"{STD}.numaNode + 1 == 1", "h100", MATCH),
    Case(f"{STD}.pciBusID == '0000:1b:00.0'", "h100", MATCH),
    Case(f"{OTHER}.shared", "channel", MATCH),
    Case(f"!{OTHER}.shared", "channel", NO_MATCH),
    # bare names of a device belong to its driver's domain
    Case(f"{OTHER}.type == 'channel' && {OTHER}.id == 0", "channel", MATCH),
    Case(f"{G}.productName > 5", "h100", RUNTIME, "no such overload"),
    # ---- versions (semver) ----------------------------------------------------------------------
    Case(f"{G}.cudaComputeCapability.compareTo(semver('8.0.0')) >= 0", "a100", MATCH),
    Case(f"{G}.cudaComputeCapability.compareTo(semver('8.0.0')) >= 0", "t4", NO_MATCH),
    Case(f"{G}.driverVersion.isGreaterThan(semver('580.95.4'))", "h100", MATCH),
    Case(f"{G}.driverVersion == semver('580.95.5')", "h100", MATCH),
    Case(
        f"{G}.cudaComputeCapability.major() == 9 && {G}.cudaComputeCapability.minor() == 0",
        "h100",
        MATCH,
    ),
    Case(f"{G}.driverVersion.isLessThan(semver('v600', true))", "h100", MATCH),
    Case(f"{G}.driverVersion.isGreaterThan(semver('580.95.5-rc.1'))", "h100", MATCH),
    Case("isSemver('1.2.3') && !isSemver('1.2')", "h100", MATCH),
    # a version compared with == to a string is an error, not false (semver's Equal)
    Case(f"{G}.cudaComputeCapability == '9.0.0'", "h100", RUNTIME, "no such overload"),
    Case("quantity('1').compareTo(semver('1.0.0')) == 0", "h100", COMPILE, "no matching overload"),
    Case(
        f"{G}.driverVersion.isLessThan(semver('600'))",
        "h100",
        RUNTIME,
        "No Major.Minor.Patch elements found",
    ),
    # ... but != of the same pair is true, no error (observed on the cluster)
    Case(f"{G}.driverVersion != '580.95.5'", "t4", MATCH),
    # ---- missing attributes and domains ---------------------------------------------------------
    Case(f"has({G}.productName)", "h100", MATCH),
    Case(f"has({G}.profile) && {G}.profile == '1g.10gb'", "h100", NO_MATCH),
    Case(f"{G}.profile == '1g.10gb'", "h100", RUNTIME, "no such key: profile"),
    Case(f"{G}.profile == '1g.10gb'", "mig", MATCH),
    Case(f"{G}.?profile.orValue('none') == 'none'", "h100", MATCH),
    Case(f"{G}['resource.kubernetes.io/pciBusID'] == ''", "h100", RUNTIME, "no such key"),
    Case("'gpu.nvidia.com' in device.attributes", "h100", MATCH),
    Case("'missing.example.com' in device.attributes", "h100", NO_MATCH),
    Case("device.attributes.exists(d, d.endsWith('kubernetes.io'))", "h100", MATCH),
    Case(f"'foo' in {MISSING}", "h100", NO_MATCH),
    Case(f"has({MISSING}.foo)", "h100", NO_MATCH),
    Case(f"{MISSING}.size() == 0", "h100", MATCH),
    Case(f"{MISSING}.foo == 'x'", "h100", RUNTIME, "no such key: foo"),
    Case("'memory' in device.capacity['missing.example.com']", "h100", NO_MATCH),
    Case(f"cel.bind(g, {G}, g.type == 'gpu' && g.architecture == 'Hopper')", "h100", MATCH),
    Case(f"cel.bind(g, {G}, has(g.profile) && g.profile == '1g.10gb')", "a100", NO_MATCH),
    # ---- capacities as quantities ---------------------------------------------------------------
    Case(f"{C}.memory.compareTo(quantity('40Gi')) >= 0", "h100", MATCH),
    Case(f"{C}.memory.compareTo(quantity('40Gi')) >= 0", "l4", NO_MATCH),
    Case(f"{C}.memory.isGreaterThan(quantity('81559Mi'))", "h100", NO_MATCH),
    Case(f"{C}.memory.isLessThan(quantity('80Gi'))", "h100", MATCH),
    Case(f"{C}.memory == quantity('81559Mi')", "h100", MATCH),
    Case(f"{C}.memory.asInteger() == 81559 * 1024 * 1024", "h100", MATCH),
    Case(f"{C}.memory.asApproximateFloat() > 8.0e10", "h100", MATCH),
    Case(f"{C}.memory.add(quantity('1Gi')).isGreaterThan(quantity('80Gi'))", "h100", MATCH),
    Case(f"{C}.memory.sub(1).isInteger() && sign({C}.memory) == 1", "t4", MATCH),
    # sign is a global function in Kubernetes, not a member (found by the e2e)
    Case(f"{C}.memory.sign() == 1", "t4", COMPILE, "'sign'"),
    Case(f"{C}.multiprocessors.isGreaterThan(quantity('10'))", "mig", MATCH),
    Case("isQuantity('1Gi') && !isQuantity('1 Gi')", "h100", MATCH),
    Case(f"{C}.memory.compareTo(quantity('200K')) > 0", "h100", RUNTIME, "quantity"),
    # capacities are typed Quantity at compile time (attributes are dyn): found by the e2e
    Case(
        f"{C}.memory == 85520809984",
        "h100",
        COMPILE,
        "found no matching overload for '_==_'",
    ),
    Case(f"{C}.memory >= 1.5", "t4", COMPILE, "found no matching overload for '_>=_'"),
    Case(f"{C}.memory > quantity('1Gi')", "h100", COMPILE, "no matching overload"),
    Case(f"{C}.memory.compareTo(quantity(40)) >= 0", "h100", COMPILE, "no matching overload"),
    Case(f"{C}.memory + 1 > 2", "h100", COMPILE, "found no matching overload for '_+_'"),
    # ---- device is typed: attributes map(string, map(string, any)) keyed by domain, capacity
    # map(string, map(string, Quantity)), driver string: the mistakes `gpu-dra lint` teaches
    Case(
        "device.attributes['memory'] >= 40000",
        "h100",
        COMPILE,
        "found no matching overload for '_>=_' applied to '(map(string, any), int)'",
    ),
    Case(
        "device.attributes['productName'] == 'NVIDIA H100 80GB HBM3'",
        "h100",
        COMPILE,
        "found no matching overload for '_==_' applied to '(map(string, any), string)'",
    ),
    Case(
        "device.capacity['memory'].compareTo(quantity('40Gi')) >= 0",
        "h100",
        COMPILE,
        "found no matching overload for 'compareTo' applied to "
        "'map(string, kubernetes.Quantity).(kubernetes.Quantity)'",
    ),
    Case(f"{C}.productName == 'NVIDIA H100 80GB HBM3'", "h100", COMPILE, "no matching overload"),
    Case("device.driver == 5", "h100", COMPILE, "found no matching overload for '_==_'"),
    Case(f"{G}.memory >= 40000", "h100", RUNTIME, "no such key: memory"),
    Case(f"{G}.pciBusID == '0000:1b:00.0'", "h100", RUNTIME, "no such key: pciBusID"),
    Case(f"{G}.driverVersion >= '550.0.0'", "h100", RUNTIME, "no such overload"),
    Case(f"{G}.cudaComputeCapability >= 8.0", "a100", RUNTIME, "no such overload"),
    Case(f"{G}.cudaComputeCapability.compareTo(semver('8.0.0')) >= 0", "l4", MATCH),
    Case(f"{C}.memory.compareTo(quantity('40000Mi')) >= 0", "t4", NO_MATCH),
    # ---- logical operators: errors are absorbed by the deciding side (commutative && / ||) ------
    Case("false && (1 / 0 == 1)", "h100", NO_MATCH),
    Case(f"{G}.nope == 1 && false", "h100", NO_MATCH),
    Case(f"{G}.nope == 1 || true", "h100", MATCH),
    Case(f"{G}.nope == 1 && true", "h100", RUNTIME, "no such key: nope"),
    Case("1 / 0 == 1", "h100", RUNTIME, "division by zero"),
    # ---- result type, syntax, unknown names -----------------------------------------------------
    Case(f"{G}.productName", "h100", RUNTIME, "could not be converted to bool"),
    Case("device.driver", "h100", COMPILE, "must evaluate to bool"),
    Case(f"({C}['memory'])", "h100", COMPILE, "must evaluate to bool"),
    Case("1 + 1", "h100", COMPILE, "must evaluate to bool"),
    Case("device.driver ==", "h100", COMPILE, "Syntax error"),
    Case("device.vendor == 'NVIDIA'", "h100", COMPILE, "undefined field 'vendor'"),
    Case("gpu.type == 'gpu'", "h100", COMPILE, "undeclared reference to"),
    Case("gpuCount(device) > 0", "h100", COMPILE, "undeclared reference to 'gpuCount'"),
    Case("'gpu-' + 0 == 'gpu-0'", "h100", COMPILE, "no matching overload"),
    Case("math.greatest(1, 2) == 2", "h100", COMPILE, "undeclared reference"),
    Case(f"has({G})", "h100", COMPILE, "has()"),
    # ---- limits ---------------------------------------------------------------------------------
    Case(_AT_LIMIT, "h100", NO_MATCH),
    Case(_AT_LIMIT.replace("x", "é", 1), "h100", COMPILE, "10240"),
    Case(f"{_HUNDRED}.all(x, {_HUNDRED}.all(y, x == y))", "h100", MATCH, python=_ITERATION_BUDGET),
    Case(
        f"{_THOUSAND}.all(x, {_THOUSAND}.all(y, x == y))",
        "h100",
        COMPILE,
        "too complex, exceeds cost limit",
        python=_ITERATION_BUDGET,
    ),
    # ---- allowMultipleAllocations ---------------------------------------------------------------
    Case("device.allowMultipleAllocations", "channel", MATCH),
    Case("device.allowMultipleAllocations == false", "h100", MATCH),
    Case("!device.allowMultipleAllocations", "channel", NO_MATCH),
)
