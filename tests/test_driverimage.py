"""e2e/cluster/driverimage.py without building (that needs root, mmdebstrap and buildah): its
cache key covers exactly the build context the Dockerfile copies and .dockerignore lets through,
and the archive it writes is named for ``ctr images import`` with its layers measured."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from e2e.cluster import driverimage
from e2e.cluster.images import ImageSpec, write_oci_archive
from e2e.cluster.paths import ClusterPaths

REPO = Path(__file__).resolve().parents[1]


def dockerfile_sources() -> set[str]:
    """Sources of the Dockerfile's COPY instructions from the build context (not --from)."""
    sources: set[str] = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return sources


def test_the_cache_key_covers_what_the_dockerfile_copies_and_dockerignore_lets_through() -> None:
    context = {*driverimage.CONTEXT_FILES, *driverimage.CONTEXT_DIRS}
    allowed = {
        line[1:]
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }

    assert dockerfile_sources() == context
    assert allowed == context
    assert "*" in (REPO / ".dockerignore").read_text().splitlines()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("Dockerfile", ".dockerignore", *driverimage.CONTEXT_FILES):
        shutil.copy(REPO / name, tmp_path / name)
    for name in driverimage.CONTEXT_DIRS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "module.py").write_text(f"# {name}\n")
    return tmp_path


def test_the_digest_follows_sources_not_bytecode_or_other_files(tree: Path) -> None:
    before = driverimage.inputs_digest(tree)
    (tree / "driver" / "__pycache__").mkdir()
    (tree / "driver" / "__pycache__" / "module.cpython-311.pyc").write_bytes(b"\x00")
    (tree / "docs").mkdir()
    (tree / "docs" / "notes.md").write_text("not in the image")
    assert driverimage.inputs_digest(tree) == before
    assert re.fullmatch(r"[0-9a-f]{12}", before)

    (tree / "controller" / "module.py").write_text("# changed\n")
    changed = driverimage.inputs_digest(tree)
    (tree / "kubelet-plugin" / "new.py").write_text("")
    added = driverimage.inputs_digest(tree)
    (tree / "Dockerfile").write_text((tree / "Dockerfile").read_text() + "# more\n")

    assert len({before, changed, added, driverimage.inputs_digest(tree)}) == 4


def test_the_archive_is_named_for_containerd_and_its_layers_measured(tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    payload = b"x" * 1000
    write_oci_archive(
        ImageSpec("localhost/other:1", {"bin/tool": payload}, {}, ["/bin/tool"], []), archive
    )
    layout = tmp_path / "layout"
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="data")

    driverimage.name_for_containerd(layout, "localhost/gpu-dra:0123456789ab")

    (manifest,) = json.loads((layout / "index.json").read_text())["manifests"]
    assert manifest["annotations"] == {
        "io.containerd.image.name": "localhost/gpu-dra:0123456789ab",
        "org.opencontainers.image.ref.name": "0123456789ab",
    }
    assert driverimage.layers_bytes(layout) == len(payload)


def test_a_download_step_is_retried_until_it_works(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def flaky(argv: list[str]) -> str:
        calls.append(argv)
        if len(calls) < 3:
            raise RuntimeError("mmdebstrap --mode=root failed (25):\nTemporary failure resolving")
        return "ok"

    monkeypatch.setattr(driverimage, "_run", flaky)
    monkeypatch.setattr(driverimage, "NETWORK_RETRY_S", 0.0)

    assert driverimage._run_retried(["mmdebstrap"]) == "ok"
    assert len(calls) == 3


def test_a_download_step_that_keeps_failing_raises_its_last_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(argv: list[str]) -> str:
        raise RuntimeError("buildah bud failed (1):\nno such host")

    monkeypatch.setattr(driverimage, "_run", broken)
    monkeypatch.setattr(driverimage, "NETWORK_RETRY_S", 0.0)

    with pytest.raises(RuntimeError, match="no such host"):
        driverimage._run_retried(["buildah", "bud"], attempts=2)


def test_the_base_root_filesystem_is_made_once_and_again_when_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Path] = []

    def fake_base(tarball: Path) -> None:
        made.append(tarball)
        tarball.write_bytes(b"rootfs %d" % len(made))

    monkeypatch.setattr(driverimage, "base_rootfs", fake_base)
    paths = ClusterPaths(cache=tmp_path, state=tmp_path / "state")
    paths.images_dir.mkdir(parents=True)

    first = driverimage.base_rootfs_cached(paths)
    again = driverimage.base_rootfs_cached(paths)
    old = time.time() - driverimage.BASE_MAX_AGE_S - 60
    os.utime(first, (old, old))
    refreshed = driverimage.base_rootfs_cached(paths)

    assert first == again == refreshed
    assert len(made) == 2
    assert refreshed.read_bytes() == b"rootfs 2"
    assert [p.name for p in paths.images_dir.iterdir()] == [first.name]
