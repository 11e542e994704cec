"""driver.cel.batch: `select` over a table of published devices gives every device the outcome of
converting it and calling `Selector.matches`, evaluating CEL once per group of devices that agree
on what the selector reads, and converting only one device per group."""

from __future__ import annotations

import random
from functools import cache

import pytest

from gpu_dra.driver.attributes import published_devices
from gpu_dra.driver.cel import (
    CelCompileError,
    CelRuntimeError,
    DeviceTable,
    DraDevice,
    PublishedDevice,
    batch,
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
def mixed_devices() -> tuple[PublishedDevice, ...]:
    """The conformance devices, every simulated profile's published devices (MIG included),
    and look-alikes that differ only in a type (bool vs int), a missing entry, a name published
    both bare and qualified, or a value that does not convert (a runtime error of that device)."""
    found: list[PublishedDevice] = list(devices().values())
    for profile in ("hgx-h100", "hgx-h100-mig", "dgx-a100", "l4x4", "t4", "mixed"):
        host = SimulatedHost.load(profile, "node-a")
        discovered = discover_devices(host.nvml, host.pci)
        found += [
            ("gpu.nvidia.com", d)
            for d in published_devices(discovered.gpus, discovered.mig_devices)
        ]
    odd: list[Device] = [
        {"name": "b", "attributes": {"flag": {"bool": True}, "type": {"string": "gpu"}}},
        {"name": "i", "attributes": {"flag": {"int": 1}, "type": {"string": "gpu"}}},
        {"name": "n", "attributes": {"type": {"string": "gpu"}}},
        {"name": "n2", "attributes": {"type": {"string": "gpu"}}, "allowMultipleAllocations": True},
        {  # the later of the two names is the value (to_cel_device's order)
            "name": "twice",
            "attributes": {"type": {"string": "gpu"}, "gpu.nvidia.com/type": {"string": "mig"}},
        },
        {"name": "bad-version", "attributes": {"type": {"string": "gpu"}, "v": {"version": "9"}}},
        {
            "name": "bad-quantity",
            "attributes": {"type": {"string": "mig"}},
            "capacity": {"memory": {"value": "lots"}},
        },
        {"name": "no-value", "attributes": {"type": {"string": "gpu"}, "v": {}}},
        {"name": "int-text", "attributes": {"type": {"string": "gpu"}, "flag": {"int": True}}},
        {"name": "two-kinds", "attributes": {"type": {"string": "gpu", "int": 3}}},
        {"name": "slash", "attributes": {"a/b/c": {"string": "x"}, "type": {"string": "gpu"}}},
        {
            "name": "mem",
            "attributes": {"type": {"string": "mig"}},
            "capacity": {"memory": {"value": "10240Mi"}, "gpu.nvidia.com/other": {"value": "1"}},
        },
    ]
    found += [("gpu.nvidia.com", d) for d in odd]
    return tuple(found)


def one_by_one(expression: str, table: DeviceTable) -> tuple[list[int], list[tuple[int, str]]]:
    selector = compile_selector(expression)
    matched, errors = [], []
    for index, (driver, device) in enumerate(table.devices):
        try:
            if selector.matches(to_cel_device(driver, device)):
                matched.append(index)
        except CelRuntimeError as error:
            errors.append((index, str(error)))
    return matched, errors


def attribute(entry: PublishedDevice, name: str) -> object:
    """The converted value of a gpu.nvidia.com attribute of `entry` (None: absent or invalid)."""
    try:
        return to_cel_device(*entry).attributes.get("gpu.nvidia.com", {}).get(name)
    except CelRuntimeError:
        return None


EXPRESSIONS = sorted(
    {case.expression for case in CASES}
    | {
        f"{G}.flag == true",
        f"{G}.flag == 1",
        f"has({G}.flag) && {G}.flag == true",
        f"'profile' in {G} && {G}.profile.startsWith('1g')",
        f"{G}.?profile.orValue('') == '3g.40gb'",
        f"{G}.flag == 1 || device.allowMultipleAllocations",
        "device.attributes['a'].b == 'x'",
        "device.attributes['a']['b/c'] == 'x'",
        "device.attributes['a/b'].c == 'x'",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('10Gi')) >= 0",
        "device.capacity['gpu.nvidia.com'].size() == 2",
        f"{G}.v == semver('1.0.0')",
        "device.attributes['gpu.nvidia.com'].exists(k, k == 'flag')",
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
    plain = table.plain()
    assert 0 < sum(plain) < len(table)  # the odd ones are evaluated alone
    kinds = {attribute(entry, "type") for i, entry in enumerate(table.devices) if plain[i]}
    alone = [i for i in range(len(table)) if not plain[i]]
    names = {table.devices[i][1]["name"] for i in alone}
    assert {"bad-version", "bad-quantity", "no-value", "int-text", "two-kinds"} <= names
    assert selection.evaluations == len(kinds) + len(alone) + 1  # "twice" is not keyed
    assert len(selection.matched) == sum(
        attribute(entry, "type") == "mig" for entry in table.devices
    )
    # bool true and int 1 are different CEL values
    flags = select(compile_selector(f"{G}.flag == true"), table)
    assert [table.devices[i][1]["name"] for i in flags.matched] == ["b"]
    # conversion errors are errors of that device, with its name
    errors = dict(selection.errors)
    by_name = {table.devices[i][1]["name"]: message for i, message in errors.items()}
    assert "device bad-version: attribute v:" in by_name["bad-version"]
    assert "device bad-quantity: capacity memory:" in by_name["bad-quantity"]


def test_only_one_device_per_group_is_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    table = DeviceTable(mixed_devices())
    converted: list[str] = []

    def counting(driver: str, device: Device) -> DraDevice:
        converted.append(device["name"])
        return to_cel_device(driver, device)

    monkeypatch.setattr(batch, "to_cel_device", counting)
    selector = compile_selector(f"{G}.type == 'mig' && {G}.productName != ''")
    selection = select(selector, table)
    assert len(converted) == selection.evaluations < len(table) / 4
    # a second selector reusing the representatives converts only the devices evaluated alone
    converted.clear()
    again = select(selector, table)
    assert again == selection
    assert len(converted) == len(table) - sum(table.plain()) + 1  # + "twice"


def test_a_device_independent_selector_runs_once_over_the_plain_devices() -> None:
    table = DeviceTable(mixed_devices())
    selection = select(compile_selector("1 + 1 == 2"), table)
    alone = len(table) - sum(table.plain())  # converted on their own: some fail to convert
    assert selection.evaluations == 1 + alone
    assert len(selection.matched) + len(selection.errors) == len(table)
    assert all(message.startswith("device ") for _, message in selection.errors)


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


def random_devices(seed: int, count: int) -> list[PublishedDevice]:
    """Devices drawn from a small space of entries, so that many agree and some collide: every
    attribute kind, bare and qualified names (sometimes both), other domains, bad texts."""
    rng = random.Random(seed)
    values: list[dict[str, object]] = [
        {"string": "gpu"},
        {"string": "mig"},
        {"int": 1},
        {"int": 2},
        {"bool": True},
        {"bool": False},
        {"version": "9.0.0"},
        {"version": "8.0.0"},
        {"version": "not-semver"},
        {"int": "1"},
        {},
    ]
    names = ["type", "gpu.nvidia.com/type", "flag", "gpu.nvidia.com/flag", "other.com/type"]
    quantities = ["10Gi", "10240Mi", "1", "bad"]
    found: list[PublishedDevice] = []
    for n in range(count):
        device: dict[str, object] = {
            "name": f"d{n}",
            "attributes": {
                name: rng.choice(values) for name in rng.sample(names, rng.randint(0, 4))
            },
            "capacity": {
                name: {"value": rng.choice(quantities)}
                for name in rng.sample(["memory", "other.com/memory"], rng.randint(0, 2))
            },
        }
        if rng.random() < 0.3:
            device["allowMultipleAllocations"] = rng.random() < 0.5
        found.append((rng.choice(["gpu.nvidia.com", "other.com"]), device))  # type: ignore[arg-type]
    return found


@pytest.mark.parametrize(
    "expression",
    [
        f"{G}.type == 'mig'",
        f"has({G}.flag) && {G}.flag == 1",
        f"{G}.?flag.orValue(false) == true || device.allowMultipleAllocations",
        "device.attributes['other.com'].type == 'gpu'",
        f"{G}.type.compareTo(semver('8.5.0')) > 0",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('10Gi')) == 0",
        "device.capacity['other.com'].size() > 0 && device.driver == 'other.com'",
        f"{G}.size() == 2",
    ],
)
def test_select_matches_the_one_by_one_loop_on_random_devices(expression: str) -> None:
    table = DeviceTable(random_devices(seed=len(expression), count=400))
    selection = select(compile_selector(expression), table)
    assert (selection.matched, selection.errors) == one_by_one(expression, table)
    assert selection.evaluations < len(table)
