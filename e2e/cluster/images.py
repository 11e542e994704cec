"""Assembles OCI image tarballs locally (no registry, no Docker) and imports them into containerd.

Four images: the busybox-based test image (static busybox from Debian with its applets linked),
the glibc test image of the real-mode tests (`glibc_test_image`: busybox plus the host's glibc
and its static ``ldconfig``, so driver libraries injected through CDI can be loaded), the pod
sandbox image (the project's own `pause`, built by toolchain.py), and the MPS daemon image
of the e2e tests (`mps_double_image`): the nvidia-cuda-mps-control TEST DOUBLE with the host
Python interpreter and just the part of its standard library the double imports. Layers are
reproducible: fixed timestamps and owners, sorted entries, so the same inputs give the same
digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
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
    executables: frozenset[str] = field(default_factory=frozenset)
    """Paths of ``files`` given as bytes that get mode 0755 (host files always do)."""


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
            info.mode = 0o755 if isinstance(source, Path) or path in spec.executables else 0o644
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


def content_tag(files: dict[str, bytes | Path]) -> str:
    """A tag naming the image's content: a hash over its paths and file contents."""
    digest = hashlib.sha256()
    for path in sorted(files):
        source = files[path]
        digest.update(path.encode() + b"\0")
        digest.update(source.read_bytes() if isinstance(source, Path) else source)
    return digest.hexdigest()[:12]


GLIBC_TEST_IMAGE = "localhost/gpu-dra/glibc-test"
"""Repository of the glibc test image; the tag is a hash of the content."""
LDCONFIG = Path("/sbin/ldconfig")


def glibc_test_image() -> ImageSpec:
    """The busybox test image plus the host's C library and dynamic loader (what ``ldd`` says
    ``/usr/bin/true`` loads) and its ``ldconfig`` (static on Debian), with an empty
    ``/etc/ld.so.conf`` that includes ``/etc/ld.so.conf.d/*.conf``: what a CUDA base image
    offers the driver's libraries and NVIDIA's ``update-ldcache`` hook."""
    base = busybox_image()
    files = dict(base.files)
    files["sbin/ldconfig"] = LDCONFIG
    files["etc/ld.so.conf"] = b"include /etc/ld.so.conf.d/*.conf\n"
    for library in _shared_libraries([Path("/usr/bin/true")]):
        files[str(library).lstrip("/")] = Path(os.path.realpath(library))
    return ImageSpec(
        reference=f"{GLIBC_TEST_IMAGE}:{content_tag(files)}",
        files=files,
        symlinks=base.symlinks,
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


MPS_DOUBLE_IMAGE = "localhost/gpu-dra/mps-control-double"
"""Repository of the MPS daemon image of the e2e tests; the tag is a hash of the content."""
MPS_DOUBLE_DIR = "opt/gpu-dra-mps-double"
"""Where the double's two modules go in the image; ``/usr/bin/nvidia-cuda-mps-control`` links to
the entry module (Python resolves the link, so the daemon module is found next to it)."""
_LDD_PATH = re.compile(r"(/\S+)")
_PROBE = """
import json, os, sys, traceback
sys.path.insert(0, sys.argv[1])
import nvidia_cuda_mps_control, mps_double_daemon
import importlib.machinery
files = sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
print(json.dumps({"executable": os.path.realpath(sys.executable), "files": files,
                  "stdlib": os.path.dirname(os.__file__)}))
"""


def _shared_libraries(binaries: list[Path]) -> set[Path]:
    """What ``ldd`` says the binaries load (the dynamic loader included), by the paths it names."""
    found: set[Path] = set()
    for binary in binaries:
        done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            continue  # not dynamic: nothing to add
        for line in done.stdout.splitlines():
            match = _LDD_PATH.search(line.split("=>")[-1])
            if match:
                found.add(Path(match[1]))
    return found


SYSTEM_PYTHON = Path("/usr/bin/python3")
"""Preferred interpreter of the MPS double image (Debian's: libpython linked in, small); else
the interpreter running the tests."""


def mps_double_image(doubles_dir: Path, python: str | None = None) -> ImageSpec:
    """The MPS daemon image of the e2e tests: the TEST DOUBLE of ``nvidia-cuda-mps-control``
    (``tests/doubles``, not NVIDIA software) as ``/usr/bin/nvidia-cuda-mps-control``, run by a
    copy of the host's Python at its host path with the standard-library modules the double
    imports (asked of that interpreter) and the shared libraries they load (``ldd``). Tagged with
    a hash of its content, so a changed double is a new image."""
    if python is None:
        python = str(SYSTEM_PYTHON) if SYSTEM_PYTHON.exists() else sys.executable
    probe = subprocess.run(
        [python, "-S", "-c", _PROBE, str(doubles_dir)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = json.loads(probe.stdout)
    interpreter = Path(found["executable"])
    stdlib = Path(found["stdlib"])
    modules = [Path(f) for f in found["files"] if Path(f).is_relative_to(stdlib)]
    files: dict[str, bytes | Path] = {str(interpreter).lstrip("/"): interpreter}
    # The prefix landmark Python looks for at start-up (os is frozen, but getpath needs os.py).
    for module in [*modules, stdlib / "os.py"]:
        files[str(module).lstrip("/")] = module
    extensions = [m for m in modules if m.suffix == ".so"]
    for library in _shared_libraries([interpreter, *extensions]):
        files[str(library).lstrip("/")] = Path(os.path.realpath(library))
    entry = doubles_dir / "nvidia_cuda_mps_control.py"
    script = entry.read_bytes().split(b"\n", 1)[1]
    files[f"{MPS_DOUBLE_DIR}/nvidia_cuda_mps_control.py"] = (
        f"#!{interpreter} -S\n".encode() + script
    )
    files[f"{MPS_DOUBLE_DIR}/mps_double_daemon.py"] = doubles_dir / "mps_double_daemon.py"
    symlinks = {
        "usr/bin/nvidia-cuda-mps-control": f"/{MPS_DOUBLE_DIR}/nvidia_cuda_mps_control.py",
        "usr/bin/python3": str(interpreter),
    }
    return ImageSpec(
        reference=f"{MPS_DOUBLE_IMAGE}:{content_tag(files)}",
        files=files,
        symlinks=symlinks,
        entrypoint=["/usr/bin/nvidia-cuda-mps-control"],
        cmd=["-f"],
        executables=frozenset({f"{MPS_DOUBLE_DIR}/nvidia_cuda_mps_control.py"}),
    )


def image_present(ctr: Path, socket: Path, reference: str) -> bool:
    listed = subprocess.run(
        [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "ls", "-q"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    return reference in listed


def tag_image(ctr: Path, socket: Path, source: str, target: str) -> None:
    """Give the image `source` (in containerd's k8s.io namespace) a second reference `target`
    (replaced if it exists): the same content under another tag, e.g. to upgrade to."""
    subprocess.run(
        [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "tag", "--force",
         source, target],
        check=True, capture_output=True,
    )  # fmt: skip


def import_images(ctr: Path, socket: Path, archives: list[Path]) -> None:
    for archive in archives:
        subprocess.run(
            [str(ctr), "--address", str(socket), "--namespace", "k8s.io", "images", "import",
             str(archive)],
            check=True, capture_output=True,
        )  # fmt: skip
