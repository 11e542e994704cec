"""`InstanceRegistry`: the plugin instances of one data dir; an instance is alive exactly while
its lock is held, whatever ended it (a clean stop, SIGKILL)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.node_locks import open_lock_file, try_flock
from gpu_dra.kubelet_plugin.plugin_instances import (
    InstanceRegistry,
    PluginInstance,
    check_instance_id,
)

POD_A = "4f1c2b9e-0000-4000-8000-00000000000a"
POD_B = "4f1c2b9e-0000-4000-8000-00000000000b"


def registered_in_a_process(data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """Another process that registers an instance and sleeps; returns it and its token."""
    process = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from pathlib import Path\n"
         "from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry\n"
         f"instance = InstanceRegistry(Path({str(data_dir)!r})).register({POD_A!r}, "
         "[Path('/sockets/dra-a.sock')])\n"
         "print(instance.token, flush=True)\n"
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def test_an_instance_is_alive_while_registered_and_forgotten_after_close(
    tmp_path: Path,
) -> None:
    registry = InstanceRegistry(tmp_path)
    instance = registry.register(POD_A, [tmp_path / "dra-a.sock"])

    assert instance.token.startswith(f"{POD_A}-")
    assert registry.alive(instance.token)
    assert InstanceRegistry(tmp_path).alive(instance.token)  # as another process sees it
    (info,) = registry.live()
    assert (info.instance_id, info.sockets, info.ready) == (
        POD_A,
        (str(tmp_path / "dra-a.sock"),),
        False,
    )
    instance.close()
    assert not registry.alive(instance.token)
    assert registry.instances() == []
    assert sorted(p.name for p in (tmp_path / "instances").iterdir()) == ["sequence"]


def test_an_instance_killed_with_sigkill_is_dead_and_its_files_are_removed(
    tmp_path: Path,
) -> None:
    registry = InstanceRegistry(tmp_path)
    process, token = registered_in_a_process(tmp_path)
    with process:
        try:
            assert registry.alive(token)
            assert registry.remove_dead() == []  # a live one is kept
        finally:
            process.kill()
    assert not registry.alive(token)
    (dead,) = registry.remove_dead()
    assert (dead.token, dead.instance_id, dead.sockets) == (token, POD_A, ("/sockets/dra-a.sock",))
    assert registry.instances() == []
    assert not registry.alive(token)


def died_while_registering(data_dir: Path, point: str) -> None:
    """A process that registers with crash point ``point`` armed, killed there (SIGKILL)."""
    script = (
        "from pathlib import Path\n"
        "from gpu_dra.kubelet_plugin import crash_points\n"
        "from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry\n"
        f"crash_points.arm(lambda p: crash_points.kill_self(p) if p == {point!r} else None)\n"
        f"InstanceRegistry(Path({str(data_dir)!r})).register({POD_B!r})\n"
    )
    process = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True)
    assert process.returncode == -9, process.stderr


@pytest.mark.parametrize(
    ("point", "left"),
    [
        (crash_points.INSTANCE_BEFORE_LOCK_RENAME, r"\.{pod}-[0-9a-f]{{8}}\.lock\.tmp"),
        (crash_points.INSTANCE_INFO_BEFORE_RENAME, r"\.{pod}-[0-9a-f]{{8}}\.json\..+\.tmp"),
    ],
)
def test_what_a_registration_killed_halfway_left_is_removed_by_the_next_start(
    tmp_path: Path, point: str, left: str
) -> None:
    died_while_registering(tmp_path, point)
    leftovers = [p.name for p in (tmp_path / "instances").iterdir() if p.name.endswith(".tmp")]
    assert [re.fullmatch(left.format(pod=POD_B), name) is not None for name in leftovers] == [True]

    registry = InstanceRegistry(tmp_path)
    registry.remove_dead()  # as the next start does, before it registers

    assert [p.name for p in (tmp_path / "instances").iterdir() if p.name.endswith(".tmp")] == []


def test_a_live_instances_files_and_a_registration_under_way_are_kept(tmp_path: Path) -> None:
    registry = InstanceRegistry(tmp_path)
    process, token = registered_in_a_process(tmp_path)
    with process:
        try:
            writing = tmp_path / "instances" / f".{token}.json.abc123.tmp"  # its write under way
            writing.write_text("{")
            registering = tmp_path / "instances" / f".{POD_B}-0123abcd.lock.tmp"
            fd = open_lock_file(registering)
            assert try_flock(fd, fcntl.LOCK_EX)  # locked, not renamed yet
            try:
                registry.remove_dead()
                assert writing.exists()
                assert registering.exists()
            finally:
                os.close(fd)
        finally:
            process.kill()


def test_probing_an_instance_does_not_make_it_look_dead_to_another_probe(
    tmp_path: Path,
) -> None:
    registry = InstanceRegistry(tmp_path)
    instance = registry.register(POD_A)
    # A probe holds the lock file shared for a moment; the owner's exclusive lock makes every
    # probe fail, and probes never block each other.
    assert all(registry.alive(instance.token) for _ in range(50))
    assert not registry.alive("no-such-token")
    assert not registry.alive("../escape")


def test_the_newest_ready_instance_is_the_one_that_publishes(tmp_path: Path) -> None:
    registry = InstanceRegistry(tmp_path)
    old = registry.register(POD_A)
    old.mark_ready()
    assert old.newest_ready()

    new = registry.register(POD_B)
    assert new.info.sequence > old.info.sequence
    # Not ready yet (recovering): the old one keeps publishing.
    assert old.newest_ready()
    assert not new.newest_ready()

    new.mark_ready()
    assert new.newest_ready()
    assert not old.newest_ready()

    new.close()  # the new one went away (a failed upgrade): the old one takes over again
    assert old.newest_ready()


def test_an_instance_without_an_id_gets_a_host_token_and_tokens_never_repeat(
    tmp_path: Path,
) -> None:
    registry = InstanceRegistry(tmp_path)
    first = registry.register("")
    second = registry.register("")
    assert first.token.startswith("host-")
    assert first.token != second.token
    assert json.loads((tmp_path / "instances" / f"{first.token}.json").read_text())["pid"] > 0


def test_owner_alive_covers_this_instance_live_others_and_legacy_entries(
    tmp_path: Path,
) -> None:
    registry = InstanceRegistry(tmp_path)
    mine: PluginInstance = registry.register(POD_A)
    other = registry.register(POD_B)
    gone = registry.register("old")
    gone.close()

    assert mine.owner_alive(mine.token)
    assert mine.owner_alive(other.token)
    assert not mine.owner_alive(gone.token)
    assert not mine.owner_alive(None)  # an entry written before instance tokens


@pytest.mark.parametrize("bad", ["a/b", "-lead", "x" * 129, "sp ace"])
def test_instance_ids_that_do_not_fit_a_file_name_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="instance id"):
        check_instance_id(bad)
