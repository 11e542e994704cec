"""A reader of glibc's ``ld.so.cache``: which libraries the dynamic linker of a root knows.

Pure parsing, no ``ldconfig -p``: the cache of a driver root (``<root>/etc/ld.so.cache``) is read
from the plugin's side, whatever libc the plugin's image has, in all three layouts (new, old,
compat). Entries map a soname to its path as the root sees it; a malformed file raises
`LdCacheError` naming the file and the fault. Used by `nvidia_userspace`.
See docs/real-nodes.md#host-driver-root-and-the-plugins-view-of-it.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

OLD_MAGIC: Final = b"ld.so-1.7.0\0"
NEW_MAGIC: Final = b"glibc-ld.so.cache1.1"

_OLD_HEADER: Final = struct.Struct("<12sI")
_OLD_ENTRY_SIZE: Final = 12
_NEW_HEADER_SIZE: Final = 48
_NEW_ENTRY_SIZE: Final = 24
_NEW_ALIGN: Final = 8

# Entry flags (glibc sysdeps/generic/ldconfig.h): the low byte says ELF or not, the next the ABI.
FLAG_TYPE_MASK: Final = 0x00FF
FLAG_ELF: Final = 0x0001
FLAG_ARCH_MASK: Final = 0xFF00
_ARCH_BITS: Final = {
    0x0000: 32,  # i386 (plain libc6)
    0x0300: 64,  # x86-64
    0x0500: 64,  # 64-bit PowerPC
    0x0800: 32,  # x32
    0x0900: 32,  # ARM hard-float
    0x0A00: 64,  # AArch64
}
"""ABI byte -> word size, for the ABIs NVIDIA's toolkit sorts (others have no word size here)."""

_ENDIAN_LITTLE: Final = 2
_ENDIAN_BIG: Final = 3


class LdCacheError(ValueError):
    """The file is not a readable ``ld.so.cache``; the message names it and what is wrong."""


@dataclass(frozen=True)
class LdCacheEntry:
    """One library the cache knows."""

    key: str
    """The soname the linker looks up, e.g. ``libcuda.so.1``."""
    value: str
    """Its path as seen from the cache's root, e.g. ``/usr/lib/x86_64-linux-gnu/libcuda.so.1``."""
    flags: int

    @property
    def is_elf(self) -> bool:
        return bool(self.flags & FLAG_TYPE_MASK & FLAG_ELF)

    @property
    def bits(self) -> int | None:
        """32 or 64 for the ABIs of `_ARCH_BITS`, None for others (and for non-ELF entries)."""
        if not self.is_elf:
            return None
        return _ARCH_BITS.get(self.flags & FLAG_ARCH_MASK)


@dataclass(frozen=True)
class LdCache:
    """The entries of one cache file, in file order (ldconfig sorts them, newest first)."""

    path: Path
    format: str
    """``new``, ``old`` or ``compat``."""
    entries: tuple[LdCacheEntry, ...]

    def libraries64(self) -> tuple[str, ...]:
        """Paths of the 64-bit libraries, each once, in entry order."""
        return tuple(dict.fromkeys(e.value for e in self.entries if e.bits == 64))


def read_ld_cache(path: Path) -> LdCache:
    """Parse the cache file at `path`; `OSError` if it cannot be read, `LdCacheError` if it is
    not a valid cache."""
    return parse_ld_cache(path.read_bytes(), path)


def parse_ld_cache(data: bytes, path: Path) -> LdCache:
    """Parse cache bytes; `path` names the file in errors and in the result."""
    if data.startswith(NEW_MAGIC):
        return LdCache(path, "new", _new_entries(data, 0, path))
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise LdCacheError(f"{path}: truncated ld.so-1.7.0 header ({len(data)} bytes)")
        _, count = _OLD_HEADER.unpack_from(data)
        end = _OLD_HEADER.size + count * _OLD_ENTRY_SIZE
        if end > len(data):
            raise LdCacheError(
                f"{path}: {count} old-format entries need {end} bytes, the file has {len(data)}"
            )
        new_at = -(-end // _NEW_ALIGN) * _NEW_ALIGN
        if data[new_at : new_at + len(NEW_MAGIC)] == NEW_MAGIC:
            return LdCache(path, "compat", _new_entries(data, new_at, path))
        return LdCache(path, "old", _old_entries(data, count, end, path))
    raise LdCacheError(
        f"{path}: not an ld.so.cache (starts with {data[:20]!r}; expected "
        f"{NEW_MAGIC.decode()!r} or {OLD_MAGIC.rstrip(bytes(1)).decode()!r})"
    )


def _old_entries(data: bytes, count: int, strings_at: int, path: Path) -> tuple[LdCacheEntry, ...]:
    entries = []
    for index in range(count):
        flags, key, value = struct.unpack_from(
            "<iII", data, _OLD_HEADER.size + index * _OLD_ENTRY_SIZE
        )
        entries.append(
            LdCacheEntry(
                key=_string(data, strings_at, key, path, index),
                value=_string(data, strings_at, value, path, index),
                flags=flags,
            )
        )
    return tuple(entries)


def _new_entries(data: bytes, start: int, path: Path) -> tuple[LdCacheEntry, ...]:
    if len(data) - start < _NEW_HEADER_SIZE:
        raise LdCacheError(
            f"{path}: truncated glibc-ld.so.cache1.1 header at offset {start} "
            f"({len(data) - start} of {_NEW_HEADER_SIZE} bytes)"
        )
    endian = _byte_order(data[start + 28], path)
    count, _strings_size = struct.unpack_from(endian + "II", data, start + 20)
    end = start + _NEW_HEADER_SIZE + count * _NEW_ENTRY_SIZE
    if end > len(data):
        raise LdCacheError(
            f"{path}: {count} entries need {end} bytes, the file has {len(data)} (truncated?)"
        )
    entry = struct.Struct(endian + "iIIIQ")
    entries = []
    for index in range(count):
        flags, key, value, _os_version, _hwcap = entry.unpack_from(
            data, start + _NEW_HEADER_SIZE + index * _NEW_ENTRY_SIZE
        )
        entries.append(
            LdCacheEntry(
                key=_string(data, start, key, path, index),
                value=_string(data, start, value, path, index),
                flags=flags,
            )
        )
    return tuple(entries)


def _byte_order(flag: int, path: Path) -> str:
    """The struct prefix for the header's endianness byte (glibc 2.33+; 0 = unset, native)."""
    if flag == _ENDIAN_LITTLE:
        return "<"
    if flag == _ENDIAN_BIG:
        return ">"
    if flag == 0:
        return "<" if sys.byteorder == "little" else ">"
    raise LdCacheError(f"{path}: invalid endianness flag {flag} in the header")


def _string(data: bytes, base: int, offset: int, path: Path, index: int) -> str:
    at = base + offset
    end = data.find(b"\0", at)
    if at >= len(data) or end < 0:
        raise LdCacheError(
            f"{path}: entry {index} points at string offset {offset}, outside the file "
            f"or unterminated ({len(data)} bytes)"
        )
    return data[at:end].decode("utf-8", errors="surrogateescape")
