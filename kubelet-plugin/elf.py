"""The ``DT_SONAME`` of an ELF shared library, read from its section headers (no ``readelf``);
whether a file is ELF at all (`is_elf`).

As NVIDIA's toolkit reads it (Go ``debug/elf``, ``DynString(DT_SONAME)``): the ``SHT_DYNAMIC``
section's entries up to ``DT_NULL``, the name in the string table that section links to. A file
without a dynamic section has no soname (``None``); a file that is not ELF, or whose headers point
outside it, raises `ElfError` naming the file. 32- and 64-bit, either byte order.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Final

ELF_MAGIC: Final = b"\x7fELF"
SHT_DYNAMIC: Final = 6
DT_NULL: Final = 0
DT_SONAME: Final = 14


class ElfError(ValueError):
    """Not a readable ELF file; the message names it."""


def is_elf(path: Path) -> bool:
    """Whether the file at `path` starts with the ELF magic (False if it cannot be read)."""
    try:
        with path.open("rb") as file:
            return file.read(len(ELF_MAGIC)) == ELF_MAGIC
    except OSError:
        return False


def read_sonames(path: Path) -> tuple[str, ...]:
    """Every ``DT_SONAME`` of the library at `path` (normally one; none without a dynamic
    section). `OSError` if it cannot be read, `ElfError` if it is not valid ELF.

    The file is mapped, not read: driver libraries are tens of MiB, the headers a few KiB."""
    with path.open("rb") as file:
        if file.seek(0, 2) == 0:
            raise ElfError(f"{path}: not an ELF file (empty)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return sonames(data, path)


def sonames(data: bytes | mmap.mmap, path: Path) -> tuple[str, ...]:
    """The ``DT_SONAME`` strings of ELF bytes; `path` names the file in errors."""
    if len(data) < 16 or data[:4] != ELF_MAGIC:
        raise ElfError(f"{path}: not an ELF file")
    klass, encoding = data[4], data[5]
    if klass not in (1, 2) or encoding not in (1, 2):
        raise ElfError(f"{path}: unknown ELF class {klass} or data encoding {encoding}")
    wide = klass == 2
    order = "<" if encoding == 1 else ">"
    try:
        if wide:
            (shoff,) = struct.unpack_from(order + "Q", data, 0x28)
            shentsize, shnum = struct.unpack_from(order + "HH", data, 0x3A)
        else:
            (shoff,) = struct.unpack_from(order + "I", data, 0x20)
            shentsize, shnum = struct.unpack_from(order + "HH", data, 0x2E)
        section = struct.Struct(order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII"))
        if shoff == 0 or shnum == 0:
            return ()
        headers = [section.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
        names: list[str] = []
        for header in headers:
            if header[1] != SHT_DYNAMIC:
                continue
            offset, size, link = header[4], header[5], header[6]
            if link >= len(headers):
                raise ElfError(f"{path}: dynamic section links to section {link} of {shnum}")
            strings = headers[link]
            strtab = data[strings[4] : strings[4] + strings[5]]
            entry = struct.Struct(order + ("qQ" if wide else "iI"))
            for at in range(offset, offset + size - entry.size + 1, entry.size):
                tag, value = entry.unpack_from(data, at)
                if tag == DT_NULL:
                    break
                if tag == DT_SONAME:
                    end = strtab.find(b"\0", value)
                    if end < 0:
                        raise ElfError(f"{path}: DT_SONAME at {value} is outside its string table")
                    names.append(strtab[value:end].decode("utf-8", errors="surrogateescape"))
        return tuple(names)
    except struct.error as error:
        raise ElfError(f"{path}: truncated ELF headers ({error})") from error
