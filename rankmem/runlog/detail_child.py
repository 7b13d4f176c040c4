"""The side file's writer process: what keeps pyarrow out of the logging rank's address space.

    python -m rankmem.runlog.detail_child PATH WORLD      (started by :class:`~rankmem.runlog.detail_pipe.DetailPipe`)

It reads frames on stdin (:mod:`rankmem.runlog.detail_pipe` spells them) and hands each collect to a
:class:`~rankmem.runlog.columnar.DetailWriter`, which batches and writes exactly as it does in-process.
It ends on a close frame or at end of input: the rank closed the pipe or died (SIGKILL included), so the
collects it had sent still reach the disk. Ctrl-C reaches the whole foreground process group: this
process ignores it and waits for its rank to finish or die.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import numpy as np

from rankmem.core.records import StepRecord
from rankmem.runlog.columnar import FLUSH_S, DetailWriter
from rankmem.runlog.detail_pipe import ADD, ADD_HEAD, CLOSE, FLUSH, KEYS, read_frames
from rankmem.runlog.layout import DETAIL_AGGREGATES


def serve(path: str, world: int, rfd: int, wfd: int, run_id: str | None = None, header_crc: str = "") -> None:
    writer = DetailWriter(path, world, run_id, header_crc)
    writer.open()
    keysets: list[tuple[tuple[str, ...], list[str]]] = []
    buffer = bytearray()
    try:
        while True:
            ready, _, _ = select.select([rfd], [], [], FLUSH_S)
            if not ready:
                writer.flush_due()  # idle: what waits goes to disk within a second, as with steady collects
                continue
            chunk = os.read(rfd, 1 << 20)
            if not chunk:
                return  # end of input: the rank is gone or done
            buffer += chunk
            for kind, body in read_frames(buffer):
                if kind == KEYS:
                    keys = tuple(json.loads(body))
                    keysets.append((keys, [f"{k}/{a}" for k in keys for a in DETAIL_AGGREGATES]))
                elif kind == ADD:
                    _add(writer, keysets, body, world)
                elif kind == FLUSH:
                    writer.flush()
                    os.write(wfd, body)  # the flush's sequence number: the rank waits for it
                elif kind == CLOSE:
                    return
    finally:
        writer.close()


def _add(writer: DetailWriter, keysets: list[tuple[tuple[str, ...], list[str]]], body: bytes, world: int) -> None:
    keyset, collect, step, when, offset, has_matrix = ADD_HEAD.unpack_from(body)
    keys, names = keysets[keyset]
    at = ADD_HEAD.size
    stats = np.frombuffer(body, dtype=np.float64, count=len(names), offset=at)
    matrix = None
    if has_matrix:
        matrix = np.frombuffer(body, dtype=np.float64, offset=at + stats.nbytes).reshape(world, len(keys))
    record = StepRecord(step, when, dict(zip(names, stats.tolist(), strict=True)), keys=keys, matrix=matrix)
    writer.add(collect, record, offset)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path, world = argv[0], int(argv[1])
    run_id = argv[2] if len(argv) > 2 and argv[2] else None
    header = argv[3] if len(argv) > 3 else ""  # the run log header's CRC-32 (rankmem.runlog.checksum)
    started = time.monotonic()
    try:
        serve(path, world, sys.stdin.fileno(), sys.stdout.fileno(), run_id, header)
    except BrokenPipeError:
        return 0  # the rank stopped reading acknowledgements: it is gone
    except Exception as exc:  # noqa: BLE001 - a boundary (rankmem.core.guard): said once on the rank's stderr
        print(f"rankmem: the side-file writer for {path} stopped after {time.monotonic() - started:.1f} s: {exc!r}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
