"""The record log W&B (``.wandb``) and SwanLab (``.swanlab``) write a run into: LevelDB's log
format (32 KiB blocks of records, each with a CRC-32, a length and a type: whole, or the first,
a middle or the last piece of a longer one) behind a 7-byte file header (a 4-byte ident, a
2-byte magic, a version). Both libraries read their files with code of the same shape; this
is that code once, without either library.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Iterator

from .base import ReadError

__all__ = ["RecordLog"]

BLOCK = 32768
HEADER = struct.Struct("<4sHB")   # ident, magic, version
RECORD = struct.Struct("<IHB")    # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
MAX_RECORD = 64 << 20  # a record in pieces longer than this (a media file) is passed over, not held
# the CRC of each record type's byte, where the record's CRC starts (both libraries)
_TYPE_CRC = {t: zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in (FULL, FIRST, MIDDLE, LAST)}


class RecordLog:
    """The payloads of one record-log file, in order: ``for offset, payload in log``. A record
    failing its CRC, or a piece out of order, is counted in ``bad`` (its first description in
    ``problem``) and passed over; a file cut short (a run still writing) ends the iteration."""

    def __init__(self, path: str, *, ident: bytes, magic: int, versions: tuple[int, ...], library: str):
        self.path, self.library = path, library
        self.bad = 0
        self.problem: str | None = None
        self.truncated = False
        self.position = 0
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size or head[:4] != ident:
            raise ReadError(path, f"not a {library} run file (it does not start with {ident.decode()!r})")
        got_ident, got_magic, version = HEADER.unpack(head)
        if got_magic != magic:
            raise ReadError(path, f"not a {library} run file (bad magic {got_magic:#06x})")
        if version not in versions:
            raise ReadError(path, f"{library} run file format version {version}; this reader knows "
                                  f"{', '.join(map(str, versions))} (a newer {library} wrote it?)")

    def _fail(self, problem: str) -> None:
        self.bad += 1
        if self.problem is None:
            self.problem = problem

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        pieces: list[bytes] = []
        start: int | None = None
        with open(self.path, "rb") as f:
            block_at = 0
            block = f.read(BLOCK)
            pos = HEADER.size
            while block:
                if len(block) - pos < RECORD.size:  # the block's tail: padding, or the file's end
                    if len(block) < BLOCK:
                        self.truncated = self.truncated or len(block) > pos
                        break
                    block_at += BLOCK
                    block, pos = f.read(BLOCK), 0
                    continue
                crc, length, kind = RECORD.unpack_from(block, pos)
                at = block_at + pos
                if kind == 0 and length == 0:  # zeroed space: the rest of the block
                    pos = len(block)
                    continue
                body = block[pos + RECORD.size:pos + RECORD.size + length]
                pos += RECORD.size + length
                self.position = block_at + pos
                if len(body) < length:
                    if len(block) < BLOCK:  # cut short: a run still writing
                        self.truncated = True
                        break
                    self._fail(f"offset {at}: a record longer than its block")
                    pieces, start = [], None
                    continue
                if kind not in _TYPE_CRC:
                    self._fail(f"offset {at}: a record of unknown type {kind}")
                    pieces, start = [], None
                    continue
                if zlib.crc32(body, _TYPE_CRC[kind]) & 0xFFFFFFFF != crc:
                    self._fail(f"offset {at}: CRC mismatch (the file is damaged there)")
                    pieces, start = [], None
                    continue
                if kind == FULL:
                    yield at, body
                elif kind == FIRST:
                    pieces, start = [body], at
                elif start is None:
                    self._fail(f"offset {at}: the middle or end of a record whose start is missing")
                elif sum(map(len, pieces)) + len(body) > MAX_RECORD:
                    self._fail(f"offset {start}: a record over {MAX_RECORD >> 20} MiB (passed over)")
                    pieces, start = [], None
                elif kind == MIDDLE:
                    pieces.append(body)
                else:
                    pieces.append(body)
                    yield start, b"".join(pieces)
                    pieces, start = [], None


def run_file(path: str, suffix: str) -> str | None:
    """The run file (``run-*.wandb``) of a run folder, or of the newest run under a folder of
    runs (W&B's ``wandb/`` with ``latest-run``, SwanLab's log folder); None if there is none."""
    direct = sorted(n for n in os.listdir(path) if n.endswith(suffix) and os.path.isfile(os.path.join(path, n)))
    if direct:
        return os.path.join(path, direct[-1])
    latest = os.path.join(path, "latest-run")
    if os.path.isdir(latest):
        found = run_file(latest, suffix)
        if found:
            return found
    runs = sorted((os.path.getmtime(os.path.join(path, n)), n) for n in os.listdir(path)
                  if os.path.isdir(os.path.join(path, n)) and ("run-" in n))
    for _, name in reversed(runs):
        inner = os.path.join(path, name)
        files = sorted(n for n in os.listdir(inner) if n.endswith(suffix))
        if files:
            return os.path.join(inner, files[-1])
    return None
