"""The driver image, built from the project's Dockerfile without a Docker engine or a registry.

`build` commits a local slim Debian base (``mmdebstrap``, cached: `base_rootfs_cached`) with
``buildah`` once per root filesystem (`base_reference`), runs ``buildah bud --layers`` on the
Dockerfile with it (chroot isolation, the host's network and CA bundle) in a persistent storage
under ``<cache>/buildah`` (so a changed tree redoes only the steps after its first changed input;
removed when over `STORAGE_MAX_BYTES`, earlier builds' images removed after a build), and exports
an OCI archive named ``localhost/gpu-dra:<inputs_digest>`` for ``ctr images import``, cached by
that digest. mmdebstrap and ``buildah bud`` are tried `NETWORK_ATTEMPTS` times. Needs root,
``mmdebstrap`` and ``buildah``. ``python -m e2e.cluster.driverimage`` builds (or finds) it and
prints the reference, archive, sizes and build time. See docs/deployment.md, "Image".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from e2e.cluster.paths import REPO_ROOT, ClusterPaths

log = logging.getLogger(__name__)

IMAGE: Final = "localhost/gpu-dra"
"""Repository of the built image; the tag is `inputs_digest`."""
SUITE: Final = "bookworm"
BASE_IMAGE: Final = f"localhost/gpu-dra/debian:{SUITE}-slim"
"""The locally made base, passed to the Dockerfile as ``BASE_IMAGE`` (its default,
``debian:bookworm-slim``, is what a build with a registry uses), tagged
``<BASE_IMAGE>-<hash of the root filesystem>`` (`base_reference`)."""
DEBIAN_MIRROR: Final = os.environ.get("GPU_DRA_DEBIAN_MIRROR", "http://deb.debian.org")
"""Where mmdebstrap (and apt inside the build) get Debian packages: ``<mirror>/debian`` and
``<mirror>/debian-security``."""
SOURCES: Final = (
    f"deb {DEBIAN_MIRROR}/debian {SUITE} main",
    f"deb {DEBIAN_MIRROR}/debian {SUITE}-updates main",
    f"deb {DEBIAN_MIRROR}/debian-security {SUITE}-security main",
)
SLIM_DPKG_OPTIONS: Final = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/groff/*",
)
"""What Debian's slim images leave out; written into the image's dpkg configuration, so the
Dockerfile's own ``apt-get install`` leaves it out too."""
APT_OPTIONS: Final = (
    'APT::Keep-Downloaded-Packages "false"',
    'Dir::Cache::pkgcache ""',
    'Dir::Cache::srcpkgcache ""',
)
"""As in Debian's container images: apt keeps neither the downloaded packages nor its binary
caches. Written into the finished root file system (`APT_CONFIG`), not given to mmdebstrap's own
apt, which needs its downloads."""
APT_CONFIG: Final = "/etc/apt/apt.conf.d/90gpu-dra-slim"
CA_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")
"""The host's CA bundle, which ``pip`` in the build checks TLS against (``--build-arg
PIP_CERT``). Its directory is mounted at ``/mnt``, an empty directory of every Debian base, so the
build leaves no mount point behind; not over the build's own bundle, which ``apt-get install
ca-certificates`` rewrites."""
CA_MOUNT: Final = f"/mnt/{CA_BUNDLE.name}"
DOCKERFILE: Final = REPO_ROOT / "Dockerfile"
CONTEXT_FILES: Final = ("pyproject.toml", "README.md")
CONTEXT_DIRS: Final = ("driver", "kube", "cli", "controller", "kubelet-plugin", "deviceclasses")
"""The build context: what .dockerignore lets through (tested against it and the Dockerfile)."""
NICE: Final = ("nice", "-n", "10")
"""The builds run at low priority: the machine is shared."""
HOST_PACKAGES: Final = ("mmdebstrap", "buildah")
STORAGE_MAX_BYTES: Final = 6 * 2**30
"""Above this the buildah storage is removed before a build, which then starts cold: a bound on
what cached layers of earlier builds (and leftovers of failed ones) may hold on the disk."""


@dataclass(frozen=True)
class DriverImage:
    reference: str
    archive: Path
    archive_bytes: int
    image_bytes: int
    """Uncompressed size of the layers (what the node's containerd unpacks)."""
    build_seconds: float | None
    """Wall time of the build that made `archive` (None: unknown, not recorded)."""


def _context_files(root: Path = REPO_ROOT) -> Iterator[Path]:
    for name in CONTEXT_FILES:
        yield root / name
    for name in CONTEXT_DIRS:
        for path in sorted((root / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path


def inputs_digest(root: Path = REPO_ROOT) -> str:
    """First 12 hex digits of a SHA-256 over the Dockerfile, .dockerignore, the build context
    (names and contents) and the recipe of this module (suite, sources, dpkg and apt options)."""
    digest = hashlib.sha256()
    for path in [root / "Dockerfile", root / ".dockerignore", *_context_files(root)]:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(repr((SUITE, BASE_IMAGE, SOURCES, SLIM_DPKG_OPTIONS, APT_OPTIONS)).encode())
    return digest.hexdigest()[:12]


def archive_path(paths: ClusterPaths, digest: str) -> Path:
    return paths.images_dir / f"gpu-dra-{digest}.tar"


BASE_MAX_AGE_S: Final = 7 * 24 * 3600
"""A cached base root filesystem older than this is made again (Debian's security updates)."""
NETWORK_ATTEMPTS: Final = 3
NETWORK_RETRY_S: Final = 15.0


def _run_retried(argv: Sequence[str], attempts: int = NETWORK_ATTEMPTS) -> str:
    """`_run` for a step that downloads: a failure is tried again after `NETWORK_RETRY_S`."""
    for attempt in range(1, attempts + 1):
        try:
            return _run(argv)
        except RuntimeError as error:
            if attempt == attempts:
                raise
            log.warning(
                "driverimage: %s failed (attempt %d of %d), retrying in %.0f s: %s",
                argv[0],
                attempt,
                attempts,
                NETWORK_RETRY_S,
                str(error).splitlines()[0],
            )
            time.sleep(NETWORK_RETRY_S)
    raise AssertionError("unreachable")


def _run(argv: Sequence[str]) -> str:
    log.info("driverimage: %s", " ".join(argv[:8]) + (" ..." if len(argv) > 8 else ""))
    done = subprocess.run([*NICE, *argv], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed ({done.returncode}):\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return str(done.stdout)


def base_rootfs_cached(paths: ClusterPaths) -> Path:
    """`base_rootfs` in the images cache, named by a hash of its recipe; made again when older
    than `BASE_MAX_AGE_S`. Call with the images lock held."""
    recipe = hashlib.sha256(
        repr((SUITE, SOURCES, SLIM_DPKG_OPTIONS, APT_OPTIONS, APT_CONFIG)).encode()
    ).hexdigest()[:12]
    tarball = paths.images_dir / f"debian-{SUITE}-slim-{recipe}.tar"
    if tarball.is_file() and time.time() - tarball.stat().st_mtime < BASE_MAX_AGE_S:
        return tarball
    partial = tarball.with_suffix(".partial")
    base_rootfs(partial)
    partial.rename(tarball)
    for stale in paths.images_dir.glob(f"debian-{SUITE}-slim-*.tar"):
        if stale != tarball:
            stale.unlink()
    return tarball


def base_rootfs(tarball: Path) -> None:
    """A slim Debian root filesystem as a tarball (mmdebstrap, minbase variant)."""
    with tempfile.TemporaryDirectory(prefix="gpu-dra-apt-") as scratch:
        apt_config = Path(scratch) / Path(APT_CONFIG).name
        apt_config.write_text("".join(f"{option};\n" for option in APT_OPTIONS))
        _run_retried(
            [
                "mmdebstrap",
                "--mode=root",
                "--variant=minbase",
                "--format=tar",
                *(f"--dpkgopt={option}" for option in SLIM_DPKG_OPTIONS),
                f"--customize-hook=copy-in {apt_config} {Path(APT_CONFIG).parent}",
                # With that configuration mmdebstrap's clean-up leaves apt's binary caches.
                '--customize-hook=rm -f "$1"/var/cache/apt/*.bin',
                SUITE,
                str(tarball),
                *SOURCES,
            ]
        )


def name_for_containerd(layout: Path, reference: str) -> None:
    """Annotate the only manifest of the OCI layout `layout` with `reference`, as
    ``ctr images import`` names images (``io.containerd.image.name``, and the tag as
    ``org.opencontainers.image.ref.name``)."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    (manifest,) = index["manifests"]
    manifest["annotations"] = {
        **manifest.get("annotations", {}),
        "io.containerd.image.name": reference,
        "org.opencontainers.image.ref.name": reference.rsplit(":", 1)[1],
    }
    index_path.write_text(json.dumps(index, sort_keys=True))


def layers_bytes(layout: Path) -> int:
    """Uncompressed size of the layers of the only image in the OCI layout `layout`."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    manifest = json.loads(_blob(layout, entry["digest"]).read_text())
    total = 0
    for layer in manifest["layers"]:
        with tarfile.open(_blob(layout, layer["digest"])) as tar:
            total += sum(member.size for member in tar.getmembers())
    return total


def _blob(layout: Path, digest: str) -> Path:
    algorithm, value = digest.split(":", 1)
    return layout / "blobs" / algorithm / value


def _tar_layout(layout: Path, archive: Path) -> None:
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w") as tar:
        for path in sorted(layout.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(layout)), recursive=False)
    partial.rename(archive)


def base_reference(rootfs: Path) -> str:
    """`BASE_IMAGE` tagged with the first 12 hex digits of a SHA-256 of the root filesystem
    tarball: committed once per tarball, so the layers built on it stay valid as cache."""
    digest = hashlib.sha256()
    with open(rootfs, "rb") as tarball:
        while chunk := tarball.read(1 << 20):
            digest.update(chunk)
    return f"{BASE_IMAGE}-{digest.hexdigest()[:12]}"


def storage_driver(kernel_filesystems: str, storage_fs_type: str) -> str:
    """buildah's storage driver: ``overlay`` (layers are differences: cheap to make and keep)
    where the kernel has it (`kernel_filesystems`, /proc/filesystems) and the storage is not
    itself on overlayfs (`storage_fs_type`, ``stat -f -c %T``; a container's root), else ``vfs``
    (every layer a full copy)."""
    has_overlay = any(line.split()[-1:] == ["overlay"] for line in kernel_filesystems.splitlines())
    return "overlay" if has_overlay and storage_fs_type != "overlayfs" else "vfs"


def storage_bytes(storage: Path) -> int:
    """Bytes of the files under `storage` (each inode once; links not followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, _, files in os.walk(storage):
        for name in files:
            info = os.lstat(os.path.join(directory, name))
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def stale_images(names: Iterable[str], keep: Iterable[str]) -> list[str]:
    """The named images of the build storage to remove after a build: all but `keep` (the
    image just built, its build stage and its base), skipping ``<none>`` (unnamed layers)."""
    kept = set(keep)
    return sorted({name for name in names if name not in kept and not name.startswith("<none>")})


def cached_steps(bud_output: str) -> int:
    """How many Dockerfile steps ``buildah bud --layers`` took from its cache (its
    ``--> Using cache <id>`` lines)."""
    return sum(line.startswith("--> Using cache ") for line in bud_output.splitlines())


def _buildah(paths: ClusterPaths) -> list[str]:
    """The buildah command line on the persistent storage, made ready for a build: without
    leftover containers of a failed build, and removed first when over `STORAGE_MAX_BYTES`.
    Call with the images lock held."""
    paths.buildah_dir.mkdir(parents=True, exist_ok=True)
    fs_type = _run(["stat", "-f", "-c", "%T", str(paths.buildah_dir)]).strip()
    driver = storage_driver(Path("/proc/filesystems").read_text(), fs_type)
    storage = paths.buildah_dir / driver
    buildah = [
        "buildah",
        f"--storage-driver={driver}",
        f"--root={storage / 'root'}",
        f"--runroot={storage / 'run'}",
    ]
    if storage.exists():
        _succeeds([*buildah, "rm", "--all"])
        size = storage_bytes(storage)
        if size > STORAGE_MAX_BYTES:
            log.warning(
                "driverimage: buildah storage %s holds %.1f GiB, more than %.1f GiB: "
                "removing it, this build starts without cached layers",
                storage,
                size / 2**30,
                STORAGE_MAX_BYTES / 2**30,
            )
            _succeeds([*buildah, "rmi", "--all", "--force"])
            shutil.rmtree(storage)
    return buildah


def _remove_stale_images(buildah: Sequence[str], keep: set[str]) -> None:
    """Remove the images of earlier builds and bases (`stale_images`), then the unnamed layers
    no named image builds on (``rmi --prune``). A failure is logged, not raised: the image is
    built, and the storage bound catches what stays."""
    try:
        listed = _run([*buildah, "images", "--noheading", "--format={{.Name}}:{{.Tag}}"])
        for name in stale_images(listed.split(), keep):
            _run([*buildah, "rmi", name])
        _run([*buildah, "rmi", "--prune"])
    except RuntimeError as error:
        log.warning("driverimage: removing earlier images failed: %s", error)


def _succeeds(argv: Sequence[str]) -> bool:
    log.info("driverimage: %s", " ".join(argv[:8]) + (" ..." if len(argv) > 8 else ""))
    done = subprocess.run([*NICE, *argv], check=False, capture_output=True, text=True)
    return done.returncode == 0


def build(paths: ClusterPaths, *, root: Path = REPO_ROOT) -> DriverImage:
    """The driver image's OCI archive, built unless cached (see the module doc)."""
    digest = inputs_digest(root)
    reference = f"{IMAGE}:{digest}"
    archive = archive_path(paths, digest)
    paths.images_dir.mkdir(parents=True, exist_ok=True)
    with open(paths.images_dir / "gpu-dra.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = archive.with_suffix(".json")
        if archive.is_file():
            recorded = json.loads(record.read_text()) if record.is_file() else {}
            return DriverImage(
                reference,
                archive,
                archive.stat().st_size,
                int(recorded.get("image_bytes", 0)),
                recorded.get("build_seconds"),
            )
        missing = [tool for tool in HOST_PACKAGES if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"building the driver image needs {', '.join(missing)} (apt)")
        started = time.monotonic()
        buildah = _buildah(paths)
        rootfs = base_rootfs_cached(paths)
        base = base_reference(rootfs)
        if not _succeeds([*buildah, "inspect", "--type=image", base]):
            container = _run([*buildah, "from", "scratch"]).strip()
            _run([*buildah, "add", container, str(rootfs), "/"])
            _run([*buildah, "config", "--cmd", "bash", container])
            _run([*buildah, "commit", "--rm", container, base])
        bud = [
            *buildah,
            "bud",
            "--layers",
            "--isolation=chroot",
            "--network=host",
            "--pull=never",
            f"--build-arg=BASE_IMAGE={base}",
            f"--volume={CA_BUNDLE.parent}:/mnt:ro",
            f"--build-arg=PIP_CERT={CA_MOUNT}",
            f"--file={root / 'Dockerfile'}",
        ]
        # The build stage first, tagged: its layers stay as the next build's cache (no image
        # builds on the stage's last layer, so `rmi --prune` would remove the stage otherwise).
        build_stage = f"{IMAGE}/build:{digest}"
        stage = _run_retried([*bud, "--target=build", f"--tag={build_stage}", str(root)])
        image = _run_retried([*bud, f"--tag={reference}", str(root)])
        log.info(
            "driverimage: steps from the layer cache: %d building the build stage, %d the image",
            cached_steps(stage),
            cached_steps(image),
        )
        with tempfile.TemporaryDirectory(prefix="gpu-dra-image-", dir=paths.cache) as scratch:
            layout = Path(scratch) / "layout"
            _run([*buildah, "push", reference, f"oci:{layout}:{reference}"])
            name_for_containerd(layout, reference)
            image_bytes = layers_bytes(layout)
            _tar_layout(layout, archive)
        _remove_stale_images(buildah, keep={reference, build_stage, base})
        seconds = round(time.monotonic() - started, 1)
        record.write_text(json.dumps({"image_bytes": image_bytes, "build_seconds": seconds}))
        for stale in paths.images_dir.glob("gpu-dra-*"):
            if stale not in (archive, record) and not stale.name.endswith(".lock"):
                stale.unlink()
    log.info("driverimage: %s in %.0f s", reference, seconds)
    return DriverImage(reference, archive, archive.stat().st_size, image_bytes, seconds)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    image = build(ClusterPaths.from_env())
    print(f"reference:     {image.reference}")
    print(f"archive:       {image.archive} ({image.archive_bytes / 2**20:.1f} MiB)")
    print(f"image (layers, uncompressed): {image.image_bytes / 2**20:.1f} MiB")
    if image.build_seconds is not None:
        print(f"build time:    {image.build_seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
