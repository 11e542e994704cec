"""e2e/cluster/driverimage.py without building (that needs root, mmdebstrap and buildah): its
cache key covers exactly the build context the Dockerfile copies and .dockerignore lets through,
and the archive it writes is named for ``ctr images import`` with its layers measured."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
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


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined as the builder joins them."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", "")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_dependencies_layer_depends_on_pyproject_only_and_the_sources_come_after() -> None:
    instructions = dockerfile_instructions()
    installs = [i for i, line in enumerate(instructions) if "pip wheel" in line]
    (deps_install,) = installs
    before = [line.split()[1:-1] for line in instructions[:deps_install] if line.startswith("COPY")]
    after = {
        word.rstrip("/")
        for line in instructions[deps_install:]
        if line.startswith("COPY") and "--from" not in line
        for word in line.split()[1:-1]
    }

    assert before == [["pyproject.toml"]]
    assert after == {*driverimage.CONTEXT_FILES, *driverimage.CONTEXT_DIRS} - {"pyproject.toml"}
    wheel_build = next(line for line in instructions if "-m build" in line)
    assert "--no-isolation" in wheel_build
    assert "--no-deps" in wheel_build


def test_the_dockerfile_lists_the_pinned_dependencies_and_build_requirements_of_pyproject(
    tmp_path: Path,
) -> None:
    """The Dockerfile's own extraction (``python3 -c '...'``), run on the project's file."""
    (command,) = [line for line in dockerfile_instructions() if "python3 -c '" in line]
    code = command.split("python3 -c '", 1)[1].split("'", 1)[0]
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")

    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = (tmp_path / "requirements.txt").read_text().split("\n")
    assert requirements == [*project["project"]["dependencies"], ""]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", r) for r in requirements[:-1])
    build_requirements = (tmp_path / "build-requirements.txt").read_text().split("\n")
    assert build_requirements == [*project["build-system"]["requires"], ""]


@pytest.mark.parametrize(
    ("filesystems", "fs_type", "driver"),
    [
        ("nodev\tsysfs\nnodev\toverlay\n\text4\n", "ext2/ext3", "overlay"),
        ("nodev\tsysfs\nnodev\toverlay\n", "overlayfs", "vfs"),
        ("nodev\tsysfs\n\text4\nnodev\toverlayfs-like\n", "ext2/ext3", "vfs"),
    ],
)
def test_the_storage_driver_is_overlay_only_where_the_kernel_and_file_system_allow_it(
    filesystems: str, fs_type: str, driver: str
) -> None:
    assert driverimage.storage_driver(filesystems, fs_type) == driver


def test_the_storage_size_counts_each_file_once(tmp_path: Path) -> None:
    (tmp_path / "layer" / "usr").mkdir(parents=True)
    (tmp_path / "layer" / "usr" / "a").write_bytes(b"a" * 3000)
    (tmp_path / "b").write_bytes(b"b" * 500)
    os.link(tmp_path / "b", tmp_path / "layer" / "b-link")
    (tmp_path / "layer" / "to-a").symlink_to(tmp_path / "layer" / "usr" / "a")

    total = driverimage.storage_bytes(tmp_path)

    assert 3500 <= total < 3500 + 200  # the symlink's own few bytes, not its target's
    assert driverimage.storage_bytes(tmp_path / "layer" / "usr") == 3000


def test_a_storage_over_the_bound_is_removed_before_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commands: list[list[str]] = []

    def fake_run(argv: list[str]) -> str:
        commands.append(argv)
        return "ext2/ext3\n"

    def fake_succeeds(argv: list[str]) -> bool:
        commands.append(argv)
        return True

    monkeypatch.setattr(driverimage, "_run", fake_run)
    monkeypatch.setattr(driverimage, "_succeeds", fake_succeeds)
    monkeypatch.setattr(driverimage, "STORAGE_MAX_BYTES", 1000)
    paths = ClusterPaths(cache=tmp_path, state=tmp_path / "state")

    buildah = driverimage._buildah(paths)
    root = Path(next(a for a in buildah if a.startswith("--root=")).split("=", 1)[1])
    storage = root.parent
    (root / "layers").mkdir(parents=True)
    (root / "layers" / "small").write_bytes(b"x" * 999)
    assert driverimage._buildah(paths) == buildah
    assert (root / "layers" / "small").is_file()
    assert not caplog.records

    (root / "layers" / "more").write_bytes(b"x" * 2)
    assert driverimage._buildah(paths) == buildah

    assert not storage.exists()
    assert "this build starts without cached layers" in caplog.text
    assert [*buildah, "rmi", "--all", "--force"] in commands


def test_after_a_build_the_earlier_builds_and_bases_are_stale() -> None:
    listed = [
        "localhost/gpu-dra:0123456789ab",
        "localhost/gpu-dra:ba9876543210",
        "localhost/gpu-dra/debian:bookworm-slim-aaaaaaaaaaaa",
        "localhost/gpu-dra/debian:bookworm-slim-bbbbbbbbbbbb",
        "<none>:<none>",
    ]
    keep = {"localhost/gpu-dra:ba9876543210", "localhost/gpu-dra/debian:bookworm-slim-bbbbbbbbbbbb"}

    assert driverimage.stale_images(listed, keep) == [
        "localhost/gpu-dra/debian:bookworm-slim-aaaaaaaaaaaa",
        "localhost/gpu-dra:0123456789ab",
    ]


def test_the_base_is_tagged_with_the_hash_of_its_root_filesystem(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(b"rootfs 1")
    first = driverimage.base_reference(rootfs)
    assert driverimage.base_reference(rootfs) == first
    rootfs.write_bytes(b"rootfs 2")

    assert re.fullmatch(re.escape(driverimage.BASE_IMAGE) + r"-[0-9a-f]{12}", first)
    assert driverimage.base_reference(rootfs) != first


def test_the_steps_taken_from_the_layer_cache_are_counted() -> None:
    output = (
        "[1/3] STEP 1/7: FROM localhost/gpu-dra/debian:bookworm-slim-0123456789ab AS deps\n"
        "[1/3] STEP 2/7: RUN apt-get update\n--> Using cache 5f1e2d\n--> 5f1e2d\n"
        "[1/3] STEP 3/7: COPY pyproject.toml ./\n--> Using cache 77aa01\n--> 77aa01\n"
        "[2/3] STEP 7/7: RUN /opt/build/bin/python -m build --wheel\n--> 9c0ffe\n"
    )

    assert driverimage.cached_steps(output) == 2
    assert driverimage.cached_steps("") == 0
