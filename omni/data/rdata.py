"""R lazy-load databases (an installed R package's ``data/Rdata.rdx`` + ``Rdata.rdb``) read without R: a
minimal reader of R's XDR serialization, enough for character/integer/real vectors and named lists."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path
from typing import Any


def read_lazyload(rdx: str | Path) -> dict[str, Any]:
    """Every object of the lazy-load database ``rdx`` (its ``.rdb`` beside it), by variable name."""
    rdx = Path(rdx)
    index = unserialize(gzip.decompress(rdx.read_bytes()))
    objects: dict[str, Any] = {}
    with open(rdx.with_suffix(".rdb"), "rb") as db:
        for name, (offset, length) in index["variables"].items():
            db.seek(offset)
            objects[name] = unserialize(decompress_chunk(db.read(length)))
    return objects


def decompress_chunk(raw: bytes) -> bytes:
    """One object of an R lazy-load .rdb: 4-byte big-endian length, then (R >= 2.10) a type
    byte Z/2/X/0 for zlib/bzip2/xz/none, else a bare zlib stream."""
    (size,) = struct.unpack(">I", raw[:4])
    kind, body = raw[4:5], raw[5:]
    data = {
        b"Z": zlib.decompress,
        b"2": bz2.decompress,
        b"X": lzma.decompress,
        b"0": bytes,
    }.get(kind, lambda _: zlib.decompress(raw[4:]))(body)
    if len(data) != size:
        raise ValueError(f"corrupt R lazy-load chunk: expected {size} bytes, got {len(data)}")
    return data


def unserialize(data: bytes) -> Any:
    """One R object from its XDR serialization: strings -> str, vectors -> list, named lists and
    vectors -> dict, NULL -> None; ValueError on another stream or object type."""
    if data[:2] != b"X\n":
        raise ValueError("not an R XDR serialization stream")
    pos = 2
    refs: list[Any] = []

    def integer() -> int:
        nonlocal pos
        (v,) = struct.unpack_from(">i", data, pos)
        pos += 4
        return v

    def item() -> Any:
        nonlocal pos
        flags = integer()
        kind, levels = flags & 0xFF, flags >> 12
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP: index into earlier symbols
            return refs[(flags >> 8) - 1]
        if kind == 1:  # SYMSXP
            refs.append(item())
            return refs[-1]
        if kind == 9:  # CHARSXP
            n = integer()
            if n == -1:
                return None  # NA_character_
            raw = data[pos : pos + n]
            pos += n
            return raw.decode("latin-1" if levels & 4 else "utf-8")
        if kind == 2:  # LISTSXP (pairlist: attributes)
            if flags & (1 << 9):
                item()  # attributes of the pairlist cell itself: unused
            tag = item() if flags & (1 << 10) else None
            out = {tag: item()}
            return {**out, **(item() or {})}
        if kind in (10, 13, 14, 16, 19):  # LGL, INT, REAL, STR, VEC
            n = integer()
            if kind in (10, 13):
                value: list[Any] = list(struct.unpack_from(f">{n}i", data, pos))
                pos += 4 * n
            elif kind == 14:
                value = list(struct.unpack_from(f">{n}d", data, pos))
                pos += 8 * n
            else:
                value = [item() for _ in range(n)]
            attrs = item() if flags & (1 << 9) else None
            if attrs and isinstance(attrs.get("names"), list) and len(attrs["names"]) == n:
                return dict(zip(attrs["names"], value))
            return value
        raise ValueError(f"unsupported R object type {kind} in serialization stream")

    version = integer()
    integer(), integer()  # writer R version, minimal reader R version
    if version == 3:  # followed by the writer's native-encoding name
        n = integer()
        pos += n
    return item()
