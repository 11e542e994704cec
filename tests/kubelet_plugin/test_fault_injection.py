"""Test-only fault injection of the outage e2e tests (`fault_injection`): the boot ID override
(a simulated reboot) and the prepare delay after `PrepareStarted` (a kubelet restarted during a
prepare). Both work on simulated nodes only and are wired into the composition root."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin import __main__ as plugin_main
from gpu_dra.kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointEntry,
    ClaimPhase,
    read_boot_id,
)
from gpu_dra.kubelet_plugin.fault_injection import (
    TEST_BOOT_ID_ENV,
    TEST_PREPARE_DELAY_ENV,
    boot_id_from_env,
    prepare_delay_from_env,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PrepareResult
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.kubelet_plugin.nodes import UID_A, Node, ok


def settings(data_dir: Path, *flags: str) -> KubeletPluginSettings:
    return KubeletPluginSettings.parse(["--node-name=node-a", f"--data-dir={data_dir}", *flags], {})


# ---- boot ID ---------------------------------------------------------------------------------


def test_the_boot_id_is_the_kernels_unless_a_simulated_node_is_given_another() -> None:
    assert boot_id_from_env({}, simulated=True) is read_boot_id
    assert boot_id_from_env({TEST_BOOT_ID_ENV: "  "}, simulated=True) is read_boot_id
    assert boot_id_from_env({TEST_BOOT_ID_ENV: "boot-2"}, simulated=True)() == "boot-2"


def test_the_boot_id_override_is_ignored_on_real_gpus(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert boot_id_from_env({TEST_BOOT_ID_ENV: "boot-2"}, simulated=False) is read_boot_id
    assert f"{TEST_BOOT_ID_ENV}=boot-2 ignored" in caplog.text


def write_checkpoint_of_boot(data_dir: Path, boot_id: str) -> None:
    """A checkpoint written during boot `boot_id`, with one prepared claim."""
    checkpoint = Checkpoint(data_dir, boot_id=lambda: boot_id)
    checkpoint.load()
    checkpoint.put(
        CheckpointEntry(
            claim=ClaimRef("default", UID_A, "claim-a"),
            phase=ClaimPhase.PREPARE_COMPLETED,
            devices=(),
            state={},
        )
    )
    assert list(checkpoint.all()) == [UID_A]


def test_a_simulated_plugin_given_a_new_boot_id_discards_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    write_checkpoint_of_boot(data_dir, read_boot_id())
    monkeypatch.setenv(TEST_BOOT_ID_ENV, "after-the-reboot")

    checkpoint = asyncio.run(plugin_main._load_checkpoint(settings(data_dir, "--simulate=t4")))

    assert checkpoint.all() == {}
    on_disk = json.loads((data_dir / "gpu-dra-checkpoint.json").read_text())
    assert (on_disk["nodeBootID"], on_disk["claims"]) == ("after-the-reboot", {})


def test_a_plugin_on_real_gpus_keeps_its_checkpoint_whatever_the_override_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    write_checkpoint_of_boot(data_dir, read_boot_id())
    monkeypatch.setenv(TEST_BOOT_ID_ENV, "after-the-reboot")

    checkpoint = asyncio.run(plugin_main._load_checkpoint(settings(data_dir)))

    assert list(checkpoint.all()) == [UID_A]


# ---- prepare delay ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "simulated", "expected"),
    [
        ({}, True, 0.0),
        ({TEST_PREPARE_DELAY_ENV: ""}, True, 0.0),
        ({TEST_PREPARE_DELAY_ENV: "2.5"}, True, 2.5),
        ({TEST_PREPARE_DELAY_ENV: "0"}, True, 0.0),
        ({TEST_PREPARE_DELAY_ENV: "2.5"}, False, 0.0),
    ],
)
def test_the_prepare_delay_is_read_on_simulated_nodes_only(
    env: dict[str, str], simulated: bool, expected: float
) -> None:
    assert prepare_delay_from_env(env, simulated=simulated) == expected


@pytest.mark.parametrize("value", ["soon", "-1", "301", "nan", "inf"])
def test_a_prepare_delay_that_is_no_sane_number_of_seconds_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match=f"{TEST_PREPARE_DELAY_ENV}='{value}' is not a number"):
        prepare_delay_from_env({TEST_PREPARE_DELAY_ENV: value}, simulated=True)


def test_a_delayed_prepare_cut_off_by_the_kubelet_is_done_once_and_found_by_the_retry(
    tmp_path: Path, inventory: NodeInventory, caplog: pytest.LogCaptureFixture
) -> None:
    # The e2e test restarts the kubelet while the prepare waits; here the call is cancelled as
    # the servicer cancels it when the kubelet goes away, and the kubelet's retry follows. A
    # whole GPU gets no PrepareStarted record: the hold is where it would be.
    caplog.set_level(logging.WARNING)
    node = Node(tmp_path, inventory)
    node.preparer = node.build_preparer(test_prepare_delay_s=0.5)
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")

    async def cut_off_then_retry() -> tuple[CheckpointEntry | None, float, PrepareResult]:
        started = time.monotonic()
        first = asyncio.create_task(node.preparer.prepare([claim]))
        for _ in range(400):  # until the prepare is held: up to 4 s
            if "holding the prepare" in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert "holding the prepare" in caplog.text
        entry = await asyncio.to_thread(node.checkpoint.get, UID_A)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        retry = await node.preparer.prepare([claim])
        return entry, time.monotonic() - started, retry[UID_A]

    held_entry, took_s, retried = asyncio.run(cut_off_then_retry())

    assert held_entry is None
    assert took_s >= 0.5
    assert [d.device_name for d in ok(retried)] == ["gpu-0"]
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    assert node.cdi.writes == [UID_A]  # prepared once
