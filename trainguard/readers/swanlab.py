"""SwanLab run logs, as SwanLab writes them locally (``swanlab.init(mode="offline")`` or
``"local"``): the ``run-<id>.swanlab`` file of a run folder (``swanlog/run-*``; the folder, or the
log folder for its newest run, works too). One ``scalar`` record per metric and step: records of
one step that follow each other are one step, each number under the key it was logged with.
The records are protobuf messages of SwanLab's own schema, so reading one needs the ``swanlab``
package (``pip install swanlab``); the container is W&B's (:mod:`trainguard.readers.recordlog`).
"""

from __future__ import annotations

from typing import Iterator

from .base import ReadError, Step, StepReader
from .recordlog import RecordLog

__all__ = ["SwanLabReader", "MAGIC"]

MAGIC = b":SWL"


def _records_schema(path: str):
    try:
        from swanlab.proto.swanlab.record.v1 import record_pb2
    except ImportError:
        raise ReadError(path, "reading a SwanLab run file needs the swanlab package: pip install swanlab") from None
    return record_pb2


class SwanLabReader(StepReader):
    format = "swanlab"

    def records(self) -> Iterator[Step]:
        pb = _records_schema(self.path)
        log = RecordLog(self.path, ident=MAGIC, magic=0xE1D6, versions=(2,), library="SwanLab")
        for offset, payload in log:
            self.position = log.position
            record = pb.Record()
            try:
                record.ParseFromString(payload)
            except Exception as exc:  # protobuf's DecodeError
                self.skip(f"not a SwanLab record: {exc}", offset=offset)
                continue
            if record.WhichOneof("record_type") != "scalar":
                self.ignored += 1
                continue
            scalar = record.scalar
            if not scalar.key or not scalar.HasField("value"):
                self.ignored += 1
                continue
            yield int(scalar.step), {scalar.key: float(scalar.value.number)}
        for _ in range(log.bad):
            self.skip(log.problem or "damaged record")
        self.position = self.total_bytes
