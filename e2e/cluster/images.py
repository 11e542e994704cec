"""Assembles OCI image tarballs locally (no registry, no Docker) and imports them into containerd.

Two images: the busybox-based test image (static busybox from Debian with its applets linked) and
the pod sandbox image (the project's own `pause`, built by toolchain.py). Layers are reproducible:
fixed timestamps and owners, sorted entries, so the same inputs give the same digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster import versions

BUSYBOX = Path("/bin/busybox")


@dataclass(frozen=True)
class ImageSpec:
    reference: str
    files: dict[str, bytes | Path]  # path in image -> content or host file
    symlinks: dict[str, str]  # path in image -> target
    entrypoint: list[str]
    cmd: list[str]


def _layer(spec: ImageSpec) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for path in list(spec.files) + list(spec.symlinks):
            parts = path.strip("/").split("/")[:-1]
            dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        dirs.update({"tmp", "etc", "dev", "proc", "sys"})
        for directory in sorted(dirs):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        for path in sorted(spec.files):
            source = spec.files[path]
            data = source.read_bytes() if isinstance(source, Path) else source
            info = tarfile.TarInfo(path.strip("/"))
            info.size = len(data)
            info.mode = 0o755 if isinstance(source, Path) else 0o644
            tar.addfile(info, io.BytesIO(data))
        for path in sorted(spec.symlinks):
            info = tarfile.TarInfo(path.strip("/"))
            info.type = tarfile.SYMTYPE
            info.linkname = spec.symlinks[path]
            tar.addfile(info)
    return buffer.getvalue()


def _blob(layout: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo("blobs/sha256/" + digest.split(":")[1])
    info.size = len(data)
    layout.addfile(info, io.BytesIO(data))
    return digest, len(data)


def write_oci_archive(spec: ImageSpec, archive: Path) -> None:
    """Write an OCI image layout tarball for `spec`, named by containerd's image-name annotation."""
    layer = _layer(spec)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w") as layout:
        layer_digest, layer_size = _blob(layout, layer)
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"],
                "Entrypoint": spec.entrypoint,
                "Cmd": spec.cmd,
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_digest, config_size = _blob(layout, json.dumps(config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest,
                    "size": layer_size,
                }
            ],
        }
        manifest_digest, manifest_size = _blob(
            layout, json.dumps(manifest, sort_keys=True).encode()
        )
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "annotations": {
                        "io.containerd.image.name": spec.reference,
                        "org.opencontainers.image.ref.name": spec.reference.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        for name, data in (
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", json.dumps(index, sort_keys=True).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            layout.addfile(info, io.BytesIO(data))


PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP = b"root:x:0:\nnogroup:x:65534:\n"


def busybox_image() -> ImageSpec:
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    return ImageSpec(
        reference=versions.TEST_IMAGE,
        files={"bin/busybox": BUSYBOX, "etc/passwd": PASSWD, "etc/group": GROUP},
        symlinks={f"bin/{applet}": "busybox" for applet in applets if applet != "busybox"},
        entrypoint=[],
        cmd=["sh"],
    )


def pause_image(pause_binary: Path) -> ImageSpec:
    return ImageSpec(
        reference=versions.PAUSE_IMAGE,
        files={"pause": pause_binary},
        symlinks={},
        entrypoint=["/pause"],
        cmd=[],
    )


def import_images(ctr: Path, socket: Path, archives: list[Path]) -> None:
    for archive in archives:
        subprocess.run(
            [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "import",
             str(archive)],
            check=True, capture_output=True,
        )  # fmt: skip
