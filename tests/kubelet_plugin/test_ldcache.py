"""ld.so.cache parsing: the three layouts ldconfig writes, and malformed files named in errors."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.elf import ElfError, read_sonames, sonames
from gpu_dra.kubelet_plugin.ldcache import (
    NEW_MAGIC,
    OLD_MAGIC,
    LdCacheError,
    parse_ld_cache,
    read_ld_cache,
)

LIB_DIR = "/usr/lib/x86_64-linux-gnu"


def _library(path: Path, soname: str | None) -> None:
    source = path.with_suffix(".c")
    source.write_text("int f(void) { return 0; }\n")
    command = ["gcc", "-shared", "-fPIC", "-o", str(path), str(source)]
    if soname:
        command.insert(3, f"-Wl,-soname,{soname}")
    subprocess.run(command, check=True)
    source.unlink()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with two libraries in the cache's directory and one outside it."""
    root = tmp_path_factory.mktemp("ldcache")
    libs = root / LIB_DIR.lstrip("/")
    libs.mkdir(parents=True)
    _library(libs / "libcuda.so.550.54.15", "libcuda.so.1")
    _library(libs / "libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1")
    (root / "opt").mkdir()
    _library(root / "opt/libhidden.so.1", "libhidden.so.1")
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text(LIB_DIR + "\n")
    return root


def cache_file(root: Path, layout: str) -> Path:
    """``ldconfig -c <layout>`` of `root` into ``<root>/etc/ld.so.cache.<layout>``."""
    name = f"/etc/ld.so.cache.{layout}"
    subprocess.run(["ldconfig", "-r", str(root), "-c", layout, "-C", name], check=True)
    return root / name.lstrip("/")


@pytest.mark.parametrize("layout", ["new", "old", "compat"])
def test_every_layout_ldconfig_writes_lists_the_libraries(root: Path, layout: str) -> None:
    cache = read_ld_cache(cache_file(root, layout))

    assert cache.format == layout
    by_key = {entry.key: entry.value for entry in cache.entries}
    assert by_key == {
        "libcuda.so.1": f"{LIB_DIR}/libcuda.so.1",
        "libnvidia-ml.so.1": f"{LIB_DIR}/libnvidia-ml.so.1",
    }
    assert {entry.bits for entry in cache.entries} == {64}
    assert set(cache.libraries64()) == set(by_key.values())


def test_the_default_cache_is_the_new_layout(root: Path) -> None:
    subprocess.run(["ldconfig", "-r", str(root)], check=True)

    cache = read_ld_cache(root / "etc/ld.so.cache")

    assert cache.format == "new"
    assert len(cache.entries) == 2


def _new_cache(entries: list[tuple[int, str, str]], *, endian: str = "<", flag: int = 2) -> bytes:
    """A hand-made glibc-ld.so.cache1.1 file (for byte orders and ABIs ldconfig here cannot
    write)."""
    strings = b""
    offsets = []
    base = 48 + 24 * len(entries)
    for _, key, value in entries:
        key_at = base + len(strings)
        strings += key.encode() + b"\0"
        value_at = base + len(strings)
        strings += value.encode() + b"\0"
        offsets.append((key_at, value_at))
    header = NEW_MAGIC + struct.pack(endian + "IIB3xI12x", len(entries), len(strings), flag, 0)
    body = b"".join(
        struct.pack(endian + "iIIIQ", flags, key_at, value_at, 0, 0)
        for (flags, _, _), (key_at, value_at) in zip(entries, offsets, strict=True)
    )
    return header + body + strings


def test_big_endian_caches_and_word_sizes_are_read() -> None:
    data = _new_cache(
        [
            (0x0303, "libcuda.so.1", "/usr/lib64/libcuda.so.1"),  # x86-64
            (0x0A03, "libcuda.so.1", "/usr/lib/aarch64/libcuda.so.1"),  # AArch64
            (0x0003, "libcuda.so.1", "/usr/lib/i386/libcuda.so.1"),  # i386
            (0x0403, "libsparc.so.1", "/usr/lib/sparc64/libsparc.so.1"),  # unknown ABI here
            (0x0300, "notelf.so", "/usr/lib/notelf.so"),  # not ELF
        ],
        endian=">",
        flag=3,
    )

    cache = parse_ld_cache(data, Path("/x/etc/ld.so.cache"))

    assert [e.bits for e in cache.entries] == [64, 64, 32, None, None]
    assert cache.libraries64() == ("/usr/lib64/libcuda.so.1", "/usr/lib/aarch64/libcuda.so.1")


@pytest.mark.parametrize(
    ("data", "fault"),
    [
        (b"", "not an ld.so.cache"),
        (b"\x7fELF\x02\x01\x01" + bytes(40), "not an ld.so.cache"),
        (NEW_MAGIC + bytes(10), "truncated glibc-ld.so.cache1.1 header"),
        (OLD_MAGIC + b"\x01", "truncated ld.so-1.7.0 header"),
        (OLD_MAGIC + struct.pack("<I", 1000) + bytes(12), "1000 old-format entries need"),
        (
            NEW_MAGIC + struct.pack("<IIB3xI12x", 100, 0, 2, 0),
            "100 entries need 2448 bytes, the file has 48",
        ),
        (
            NEW_MAGIC
            + struct.pack("<IIB3xI12x", 1, 0, 2, 0)
            + struct.pack("<iIIIQ", 0x303, 9999, 0, 0, 0),
            "entry 0 points at string offset 9999",
        ),
        (
            NEW_MAGIC + struct.pack("<IIB3xI12x", 0, 0, 7, 0),
            "invalid endianness flag 7",
        ),
    ],
)
def test_a_malformed_cache_is_an_error_naming_the_file(data: bytes, fault: str) -> None:
    path = Path("/driver-root/etc/ld.so.cache")

    with pytest.raises(LdCacheError) as error:
        parse_ld_cache(data, path)

    assert str(error.value).startswith(f"{path}: ")
    assert fault in str(error.value)


def test_an_unterminated_string_is_an_error(root: Path) -> None:
    data = cache_file(root, "new").read_bytes()

    with pytest.raises(LdCacheError, match="unterminated"):
        parse_ld_cache(data.rstrip(b"\0")[: data.rindex(b".so.1")], Path("/c"))


# ---- ELF sonames -------------------------------------------------------------------------------


def test_the_soname_of_a_shared_library_is_read(root: Path) -> None:
    assert read_sonames(root / LIB_DIR.lstrip("/") / "libcuda.so.550.54.15") == ("libcuda.so.1",)


def test_a_library_without_soname_has_none(tmp_path: Path) -> None:
    _library(tmp_path / "libplain.so", None)

    assert read_sonames(tmp_path / "libplain.so") == ()


def test_a_32_bit_library_soname_is_read(tmp_path: Path) -> None:
    source = tmp_path / "f.c"
    source.write_text("int f(void) { return 0; }\n")
    library = tmp_path / "libf.so"
    flags = ["-m32", "-nostdlib", "-shared", "-fPIC", "-Wl,-soname,libf.so.2"]
    subprocess.run(["gcc", *flags, "-o", str(library), str(source)], check=True)

    assert library.read_bytes()[4] == 1  # ELFCLASS32
    assert read_sonames(library) == ("libf.so.2",)


@pytest.mark.parametrize(
    ("data", "fault"),
    [
        (b"", "not an ELF file"),
        (b"#!/bin/sh\nexit 0\n", "not an ELF file"),
        (b"\x7fELF\x03\x01" + bytes(60), "unknown ELF class 3"),
        (
            b"\x7fELF\x02\x01\x01"
            + bytes(33)
            + struct.pack("<Q", 10_000)
            + bytes(10)
            + struct.pack("<HH", 64, 3),
            "truncated ELF headers",
        ),
    ],
)
def test_what_is_not_elf_is_an_error_naming_the_file(
    data: bytes, fault: str, tmp_path: Path
) -> None:
    path = tmp_path / "libbroken.so.1"
    path.write_bytes(data)

    with pytest.raises(ElfError) as error:
        read_sonames(path)

    assert str(error.value).startswith(f"{path}: ")
    assert fault in str(error.value)
    if data:
        with pytest.raises(ElfError):
            sonames(data, path)
