"""bench/cel on a small inventory: the devices are rendered as published (every GPU whole plus
every MIG partition), and `select` agrees with evaluating the bench selector device by device."""

from __future__ import annotations

import json
from collections import Counter

from bench.cel.__main__ import SELECTOR, read_inventory, write_inventory
from bench.cel.inventory import DRIVER, inventory
from gpu_dra.driver.cel import DeviceTable, compile_selector, select, to_cel_device


def test_every_gpu_is_published_whole_and_with_every_mig_partition() -> None:
    pool = list(inventory(2))  # one hgx-h100 node, one dgx-a100 node
    assert len(pool) == 2 * 8 * 26
    per_gpu = Counter(
        (entry.node, entry.device["attributes"]["resource.kubernetes.io/pciBusID"]["string"])
        for entry in pool
    )
    assert set(per_gpu.values()) == {26}
    h100 = Counter(
        entry.device["attributes"].get("profile", {}).get("string", "whole")
        for entry in pool
        if entry.node == "node-0000"
    )
    assert h100 == {  # even nodes are hgx-h100 (odd ones dgx-a100: the same 25 partitions)
        "whole": 8,
        "1g.10gb": 56,
        "1g.10gb+me": 56,
        "1g.20gb": 32,
        "2g.20gb": 24,
        "3g.40gb": 16,
        "4g.40gb": 8,
        "7g.80gb": 8,
    }
    names = [(entry.node, entry.device["name"]) for entry in pool]
    assert len(set(names)) == len(names)


def test_select_over_the_written_inventory_agrees_with_evaluating_each_device(tmp_path) -> None:
    path = tmp_path / "inventory.jsonl"
    assert write_inventory(path, 2, SELECTOR) == 2 * 8 * 26
    assert json.loads(path.read_text().splitlines()[0]) == {"selector": SELECTOR}
    pool = read_inventory(path)
    assert pool == [(DRIVER, entry.device) for entry in inventory(2)]
    selector = compile_selector(SELECTOR)
    table = DeviceTable(pool)
    selection = select(selector, table)
    assert selection.matched == [
        i for i, entry in enumerate(pool) if selector.matches(to_cel_device(*entry))
    ]
    assert not selection.errors
    assert all(table.plain())  # every published device groups
    # The H100s' 1g.20gb, 2g, 3g, 4g and 7g slices (>= 10Gi, cc 9.0): 11 per GPU.
    assert len(selection.matched) == 8 * 11
    assert selection.evaluations < 40
