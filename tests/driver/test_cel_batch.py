"""driver.cel.batch: `select` over a table gives every device the outcome of `Selector.matches`,
evaluating CEL once per group of devices that agree on what the selector reads."""

from __future__ import annotations

from functools import cache

import pytest

from gpu_dra.driver.attributes import published_devices
from gpu_dra.driver.cel import (
    CelCompileError,
    CelRuntimeError,
    DeviceTable,
    DraDevice,
    compile_selector,
    select,
    to_cel_device,
)
from gpu_dra.driver.cel.source import device_footprint
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import Device
from tests.cel_conformance import CASES, devices

G = "device.attributes['gpu.nvidia.com']"


@cache
def mixed_devices() -> tuple[DraDevice, ...]:
    """The conformance devices, every simulated profile's published devices (MIG included),
    and look-alikes that differ only in a type (bool vs int) or a missing entry."""
    found = [to_cel_device(driver, device) for driver, device in devices().values()]
    for profile in ("hgx-h100", "hgx-h100-mig", "dgx-a100", "l4x4", "t4", "mixed"):
        host = SimulatedHost.load(profile, "node-a")
        discovered = discover_devices(host.nvml, host.pci)
        found += [
            to_cel_device("gpu.nvidia.com", d)
            for d in published_devices(discovered.gpus, discovered.mig_devices)
        ]
    odd: list[Device] = [
        {"name": "b", "attributes": {"flag": {"bool": True}, "type": {"string": "gpu"}}},
        {"name": "i", "attributes": {"flag": {"int": 1}, "type": {"string": "gpu"}}},
        {"name": "n", "attributes": {"type": {"string": "gpu"}}},
    ]
    found += [to_cel_device("gpu.nvidia.com", d) for d in odd]
    return tuple(found)


def one_by_one(expression: str, table: DeviceTable) -> tuple[list[int], list[tuple[int, str]]]:
    selector = compile_selector(expression)
    matched, errors = [], []
    for index, device in enumerate(table.devices):
        try:
            if selector.matches(device):
                matched.append(index)
        except CelRuntimeError as error:
            errors.append((index, str(error)))
    return matched, errors


EXPRESSIONS = sorted(
    {case.expression for case in CASES}
    | {
        f"{G}.flag == true",
        f"{G}.flag == 1",
        f"has({G}.flag) && {G}.flag == true",
        f"'profile' in {G} && {G}.profile.startsWith('1g')",
        f"{G}.?profile.orValue('') == '3g.40gb'",
    }
)


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_select_gives_each_device_its_own_outcome(expression: str) -> None:
    try:
        selector = compile_selector(expression)
    except CelCompileError:
        return  # nothing to evaluate
    table = DeviceTable(mixed_devices())
    selection = select(selector, table)
    assert (selection.matched, selection.errors) == one_by_one(expression, table)


def test_devices_that_agree_on_what_the_selector_reads_are_evaluated_once() -> None:
    table = DeviceTable(mixed_devices())
    selection = select(compile_selector(f"{G}.type == 'mig'"), table)
    assert selection.evaluations == len(
        {d.attributes.get("gpu.nvidia.com", {}).get("type") for d in table.devices}
    )
    assert len(selection.matched) == sum(
        d.attributes.get("gpu.nvidia.com", {}).get("type") == "mig" for d in table.devices
    )
    # bool true and int 1 are different CEL values
    flags = select(compile_selector(f"{G}.flag == true"), table)
    assert [table.devices[i].name for i in flags.matched] == ["b"]


def test_a_device_independent_selector_runs_once() -> None:
    table = DeviceTable(mixed_devices())
    selection = select(compile_selector("1 + 1 == 2"), table)
    assert selection.evaluations == 1
    assert selection.matched == list(range(len(table)))


@pytest.mark.parametrize(
    ("expression", "footprint"),
    [
        (
            f"device.driver == 'x' && {G}.type == 'gpu'",
            {("driver",), ("attributes", "gpu.nvidia.com", "type")},
        ),
        (
            "device.capacity['gpu.nvidia.com']['memory'].compareTo(quantity('1')) > 0",
            {("capacity", "gpu.nvidia.com", "memory")},
        ),
        (f"'x' in {G} || {G}.size() > 3", {("attributes", "gpu.nvidia.com")}),
        (f"{G}.?profile.orValue('') == ''", {("attributes", "gpu.nvidia.com")}),
        ("true", set()),
        ("device.attributes.exists(d, d == 'x')", None),
        ("'gpu.nvidia.com' in device.attributes", None),
        ("[1].all(device, device > 0)", None),
        ("cel.bind(a, device.attributes, a['x'].size() == 0)", None),
        ("device.attributes['gpu.nvidia\\x2ecom'].type == 'gpu'", None),
        ("device.attributes[r'gpu.nvidia.com'].type == 'gpu'", None),
    ],
)
def test_footprint_is_known_only_for_plain_paths(expression, footprint):
    got = device_footprint(expression)
    assert (None if got is None else set(got)) == footprint
