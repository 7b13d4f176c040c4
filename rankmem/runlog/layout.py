"""The run log's layout, defined once: the writer follows it, the reader relies on it.

``rankmem.jsonl`` is JSON Lines. Line 1 is the header (``"kind": "header"``, ``"schema"``, versions,
world size, per-rank host and device, the run's config, ``"run_id"``, and ``"detail"``: the side file's
name). Every other line is one collect's aggregates, written whole in one ``write(2)``::

    {"kind":"step","step":12,"time":1712345678.5,"metrics":{"K/max":3.5,"K/max_rank":1,...}}

and, where the log had to drop collects (a full disk, a loop faster than the disk), a gap line::

    {"kind":"gap","first":40,"last":59,"count":20,"why":"the disk refused it (File too large)"}

The per-rank values live in the side file ``rankmem.ranks.f64`` only: records of little-endian 8-byte
words, so that a reader maps a collect's values straight into a numpy array::

    file header  "RANKMEM\\0" | version | world | run id (16 ASCII bytes) | CRC-32 of the log's header line
    record       kind | n | n payload words | checksum of the record's words before it (:func:`checksums`)
      KEYS       payload: key-set id | byte length | a JSON list of key names, zero-padded to 8 bytes
      COLLECT    payload: step (i64) | time (f64) | the log's size before this collect's line | key-set
                 id | K | world x K float64 (rank-major; NaN where absent; K = 0: no per-rank values)
      GAP        payload: first step | last step | collects dropped | byte length | why (UTF-8, padded)

A key set is written (once) before the first collect that uses it. A record is written before its
line (a GAP before its gap line), both whole; a write the disk refuses part-way is cut back, so the
files hold whole records only. The file header's CRC-32 tells a damaged header line (JSON has none)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from rankmem.core.rundir import DETAIL_NAME as DETAIL_NAME
from rankmem.core.rundir import RUN_ID_FIELD as RUN_ID_FIELD
from rankmem.core.rundir import RUN_LOG_NAME as RUN_LOG_NAME

if TYPE_CHECKING:
    import numpy as np

SCHEMA = 3
SUPPORTED_SCHEMAS = (3,)
HEADER_KIND, STEP_KIND, GAP_KIND = "header", "step", "gap"
SEPARATORS = (",", ":")
STEP_MIN, STEP_MAX = -(2**63), 2**63 - 1
"""Steps are 64-bit integers: the reader holds them in an int64 array."""

MAGIC = b"RANKMEM\0"
VERSION = 2
FILE_HEADER = struct.Struct("<8sQQ16sQ")
RECORD_HEAD = struct.Struct("<QQ")
COLLECT_HEAD = struct.Struct("<qdQQQ")
KEYS_HEAD = struct.Struct("<QQ")
GAP_HEAD = struct.Struct("<qqQQ")
KEYS, COLLECT, GAP = 1, 2, 3
MAX_WORDS = 1 << 28
"""Most payload words a reader accepts in one record (2 GiB): a damaged length is not an allocation."""


def padded(data: bytes) -> bytes:
    """``data`` zero-padded to a whole number of 8-byte words."""
    return data + b"\0" * (-len(data) % 8)


def checksums(words: np.ndarray) -> np.ndarray:
    """Each row's checksum: each word times an odd weight of its position, mixed (xor-shift, times the weight,
    xor-shift: a plain weighted sum misses two sign bits flipped), summed modulo 2**64; by 128 KB slices."""
    import numpy as np  # here: `import rankmem` and Monitor() load no numpy (the sink thread does)
    rows = words.reshape(-1, words.shape[-1])
    total = np.zeros(len(rows), dtype=np.uint64)
    step = max(1, (1 << 14) // max(rows.shape[1], 1))
    for at in range(0, rows.shape[1], 1 << 14):
        weights = np.arange(2 * at + 1, 2 * min(at + (1 << 14), rows.shape[1]), 2, dtype=np.uint64)  # 2i + 1
        weights *= np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap modulo 2**64, silently
        for r in range(0, len(rows), step):
            mixed = rows[r : r + step, at : at + (1 << 14)] * weights
            mixed ^= mixed >> 29
            mixed *= weights
            mixed ^= mixed >> 32
            total[r : r + step] += mixed.sum(axis=-1, dtype=mixed.dtype)
    return total.reshape(words.shape[:-1])
