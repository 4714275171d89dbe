"""TensorBoard event files (``events.out.tfevents.*``) without TensorFlow or TensorBoard.

The file is a sequence of TFRecords::

    uint64 length | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)

(little-endian; ``masked = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32``), each ``data``
an ``Event`` protocol buffer decoded here by hand, reading only what a replay needs:

- ``Event.step`` (field 2, int64) and ``Event.summary`` (field 5);
- ``Summary.value`` (field 1, repeated) -> ``Value.tag`` (1), ``Value.simple_value``
  (2, float32: what ``SummaryWriter.add_scalar`` writes by default), ``Value.metadata``
  (9, for the plugin name) and ``Value.tensor`` (8, what TF2's ``tf.summary.scalar`` and
  ``add_scalar(new_style=True)`` write): a ``TensorProto`` with one element, read from
  ``float_val`` (5), ``double_val`` (6), ``int_val`` (7), ``int64_val`` (10) or
  ``tensor_content`` (4) for DT_FLOAT / DT_DOUBLE / DT_INT32 / DT_INT64.

Images, histograms, text, graphs and non-scalar tensors are passed over. Values are
grouped by step: the events of one step that follow each other become one step (a writer
emits one event per tag).

Both CRCs of every record are checked: a mismatch is an error naming the byte offset of
the record (the file is corrupt, or not an event file). A record past ``MAX_RECORD_BYTES`` is
no scalar record: passed over unread and counted in ``skipped``. A record cut short at the very end
of the file (a writer still running, or killed) is counted in ``skipped``, not raised.
A directory is read as all ``events.out.tfevents.*`` files directly in it, in name order
(the names start with a timestamp).
"""

from __future__ import annotations

import os
import struct
from typing import Any, Iterator

from .base import ReadError, Step, StepReader, open_binary

# A scalar record is an Event of a few hundred bytes (a TF1 merged summary of every scalar of a
# step: tens of KiB). Records up to MAX_RECORD_BYTES are read and CRC-checked; larger ones
# (graphs, images, or a corrupt length) are passed over unread and counted in ``skipped``, so a
# small corrupt .gz cannot cost seconds of pure-Python CRC and its size in memory. A length
# past MAX_PASS_OVER_BYTES is no record at all: an error.
MAX_RECORD_BYTES = 1 << 20
MAX_PASS_OVER_BYTES = 1 << 30

# -------------------------------------------------------------------------- CRC32C


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()
# Slicing-by-8: _T[k][b] is the CRC of byte b followed by k zero bytes, so 8 input bytes
# cost one loop iteration (about 1.5x the byte-at-a-time loop in CPython).
_T = [_TABLE]
for _k in range(7):
    _T.append([(_TABLE[c & 0xFF] ^ (c >> 8)) for c in _T[-1]])
_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _T
_PAIRS = struct.Struct("<II")


def _crc32c_py(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    n = len(data)
    end8 = n - n % 8
    if end8:
        for a, b in _PAIRS.iter_unpack(memoryview(data)[:end8]):
            a ^= crc
            crc = (_T7[a & 0xFF] ^ _T6[(a >> 8) & 0xFF] ^ _T5[(a >> 16) & 0xFF] ^ _T4[a >> 24]
                   ^ _T3[b & 0xFF] ^ _T2[(b >> 8) & 0xFF] ^ _T1[(b >> 16) & 0xFF] ^ _T0[b >> 24])
    for byte in data[end8:]:
        crc = _T0[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _accelerated():
    """A C implementation when one happens to be installed; the pure-Python table otherwise."""
    try:
        import google_crc32c

        if google_crc32c.implementation == "c":
            return lambda data: google_crc32c.value(bytes(data))
    except Exception:
        pass
    try:
        import crc32c as _c

        return lambda data: _c.crc32c(bytes(data))
    except Exception:
        pass
    return _crc32c_py


crc32c = _accelerated()


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# -------------------------------------------------------------------------- protobuf wire format


class ProtoError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)``: an int for varints, bytes for the others (Any: the
    wire type, which the callers test, says which)."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtoError("field number 0")
        value: Any
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ProtoError(f"unsupported wire type {wire} (field {number})")
        if pos > end:
            raise ProtoError(f"field {number} runs past the end of its message")
        yield number, wire, value


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _packed_varints(value: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(v)
    return out


DT_FLOAT, DT_DOUBLE, DT_INT32, DT_INT64 = 1, 2, 3, 9


def _tensor_scalar(buf: bytes) -> float | None:
    """The one value of a scalar TensorProto, or None (non-scalar, non-numeric, empty)."""
    dtype = 0
    elements = 1
    content = b""
    values: list[float] = []
    for number, wire, value in fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 2 and wire == 2:  # TensorShapeProto: dim (2) -> Dim.size (1)
            for n2, w2, dim in fields(value):
                if n2 == 2 and w2 == 2:
                    for n3, w3, size in fields(dim):
                        if n3 == 1 and w3 == 0:
                            elements *= _int64(size)
        elif number == 4 and wire == 2:
            content = value
        elif number == 5:  # float_val: packed (2) or one per field (5)
            values.extend(struct.unpack(f"<{len(value) // 4}f", value) if wire == 2 else struct.unpack("<f", value))
        elif number == 6:
            values.extend(struct.unpack(f"<{len(value) // 8}d", value) if wire == 2 else struct.unpack("<d", value))
        elif number in (7, 10):  # int_val / int64_val
            ints = _packed_varints(value) if wire == 2 else [value]
            values.extend(float(_int64(i) if number == 10 else ((i + (1 << 31)) % (1 << 32)) - (1 << 31))
                          for i in ints)
    if elements != 1:
        return None
    if content:
        fmt = {DT_FLOAT: "<f", DT_DOUBLE: "<d", DT_INT32: "<i", DT_INT64: "<q"}.get(dtype)
        if fmt is None or len(content) != struct.calcsize(fmt):
            return None
        return float(struct.unpack(fmt, content)[0])
    if dtype not in (DT_FLOAT, DT_DOUBLE, DT_INT32, DT_INT64, 0) or not values:
        return None
    return float(values[0])  # a scalar may be stored once for "all elements equal"


def _plugin_name(metadata: bytes) -> str:
    for number, wire, value in fields(metadata):
        if number == 1 and wire == 2:  # SummaryMetadata.plugin_data -> PluginData.plugin_name (1)
            for n2, w2, name in fields(value):
                if n2 == 1 and w2 == 2:
                    return name.decode("utf-8", errors="replace")
    return ""


def parse_event(data: bytes) -> tuple[int, float | None, dict[str, float]]:
    """``(step, wall_time, {tag: value})`` of one Event: only scalar summary values."""
    step = 0
    wall_time = None
    scalars: dict[str, float] = {}
    for number, wire, value in fields(data):
        if number == 1 and wire == 1:
            wall_time = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            step = _int64(value)
        elif number == 5 and wire == 2:
            for n1, w1, val in fields(value):
                if n1 != 1 or w1 != 2:
                    continue
                tag = ""
                scalar = None
                tensor = None
                plugin = ""
                for n2, w2, v in fields(val):
                    if n2 == 1 and w2 == 2:
                        tag = v.decode("utf-8", errors="replace")
                    elif n2 == 2 and w2 == 5:
                        scalar = struct.unpack("<f", v)[0]
                    elif n2 == 8 and w2 == 2:
                        tensor = v
                    elif n2 == 9 and w2 == 2:
                        plugin = _plugin_name(v)
                if scalar is None and tensor is not None and plugin in ("", "scalars"):
                    scalar = _tensor_scalar(tensor)
                if tag and scalar is not None:
                    scalars[tag] = scalar
    return step, wall_time, scalars


# -------------------------------------------------------------------------- records


def _own_event_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if "tfevents" in n)


def run_directories(logdir: str) -> list[str]:
    """The runs of a TensorBoard log directory as TensorBoard sees them: every directory of the
    tree that holds event files itself (``logdir/<project>/<experiment>/`` for verl,
    ``output/runs/<date_host>/`` for the Hugging Face Trainer)."""
    runs = []
    for directory, subdirs, names in os.walk(logdir):
        subdirs.sort()
        if any("tfevents" in n for n in names):
            runs.append(directory)
    return runs


def event_files(path: str) -> list[str]:
    """The event files to read for ``path``: the file itself, the files of a run directory, or
    those of the one run a log directory tree holds (several runs: an error naming them)."""
    if not os.path.isdir(path):
        return [path]
    files = _own_event_files(path)
    if files:
        return files
    runs = run_directories(path)
    if not runs:
        raise ReadError(path, "directory holds no events.out.tfevents.* file, nor does any directory under it")
    if len(runs) > 1:
        shown = ", ".join(os.path.relpath(r, path) for r in runs[:5]) + (" ..." if len(runs) > 5 else "")
        raise ReadError(path, f"holds {len(runs)} TensorBoard runs ({shown}); replay one of them, "
                              f"e.g. trainguard replay {runs[0]}")
    return _own_event_files(runs[0])


def looks_like_tfrecord(head: bytes) -> bool:
    return len(head) >= 12 and struct.unpack("<I", head[8:12])[0] == masked_crc32c(head[:8])


def _pass_over(f, n: int) -> int:
    """Read past ``n`` bytes of ``f`` in pieces (never held whole); how many were there."""
    done = 0
    while done < n:
        chunk = f.read(min(n - done, 1 << 20))
        if not chunk:
            break
        done += len(chunk)
    return done


class TensorBoardReader(StepReader):
    format = "tensorboard"
    plain_loss = True

    def __init__(self, path, *, verify_crc: bool = True):
        self.files = event_files(os.fspath(path))
        super().__init__(path)
        if len(self.files) > 1 or self.files[0] != self.path:
            self.total_bytes = sum(os.path.getsize(f) for f in self.files)
        self.verify_crc = verify_crc

    def records(self) -> Iterator[Step]:
        done = 0
        for name in self.files:
            for step, metrics in self._file(name, done):
                yield step, metrics
            done += os.path.getsize(name)
        self.position = self.total_bytes

    def _file(self, name: str, base: int) -> Iterator[Step]:
        try:
            f = open_binary(name)
        except OSError as exc:
            raise ReadError(name, f"cannot open: {exc.strerror or exc}") from None
        with f:
            offset = 0
            while True:
                header = f.read(12)
                if not header:
                    return
                if len(header) < 12:
                    self._truncated(name, offset, "record header")
                    return
                length, length_crc = struct.unpack("<QI", header)
                if self.verify_crc and masked_crc32c(header[:8]) != length_crc:
                    raise ReadError(name, "record length fails its CRC check: the file is corrupt or is not "
                                          "a TensorBoard event file", offset=offset)
                if length > MAX_PASS_OVER_BYTES:
                    raise ReadError(name, f"record claims {length} bytes; corrupt file", offset=offset)
                if length > MAX_RECORD_BYTES:
                    if _pass_over(f, length + 4) < length + 4:
                        self._truncated(name, offset, f"record of {length} bytes")
                        return
                    self.skip(f"record of {length} bytes, larger than a scalar record ({MAX_RECORD_BYTES >> 20} MiB): "
                              f"passed over unread", offset=offset)
                    offset += 16 + length
                    self.position = base + offset
                    continue
                data = f.read(length)
                footer = f.read(4)
                if len(data) < length or len(footer) < 4:
                    self._truncated(name, offset, f"record of {length} bytes")
                    return
                if self.verify_crc and masked_crc32c(data) != struct.unpack("<I", footer)[0]:
                    raise ReadError(name, f"record data ({length} bytes) fails its CRC check: the file is corrupt",
                                    offset=offset)
                try:
                    step, _wall, scalars = parse_event(data)
                except (ProtoError, struct.error) as exc:
                    self.skip(f"unreadable Event protobuf: {exc}", offset=offset)
                    scalars = {}
                    step = 0
                offset += 16 + length
                self.position = base + offset
                if scalars:
                    if step < 0:
                        self.skip(f"negative step {step}", offset=offset)
                        continue
                    yield step, scalars
                else:
                    self.ignored += 1  # file_version, graphs, images, histograms ...

    def _truncated(self, name: str, offset: int, what: str) -> None:
        self.skipped += 1
        text = str(ReadError(name, f"{what} cut short at the end of the file (still being written?)",
                             offset=offset))
        self.problems.append(text)
