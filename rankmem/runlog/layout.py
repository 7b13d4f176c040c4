"""The run log's layout: defined once here, followed by the writer, relied on by the reader.

A run log is JSON Lines, one whole line per write. Line 1 is the header (``"kind": "header"``,
``"schema"``, versions, world size, per-rank host and device, config, and since schema 2 ``"detail"``:
where the per-rank values are). Every other line is a step, written compactly (no spaces) with its
fields in :data:`STEP_FIELDS` order.

Schema 2 (``"detail": "rankmem.ranks.arrow"``): a step line holds the aggregates only, small enough to
read with ``tail -f`` at any world size::

    {"kind":"step","step":12,"time":1712345678.5,"metrics":{"K/max":3.5,...}}

and the per-rank values go to the columnar side file :data:`DETAIL_NAME` next to it (an Arrow IPC
stream; its columns are :data:`DETAIL_COLUMNS`, see :mod:`rankmem.runlog.columnar`). Schema 1, and
schema 2 with ``"detail": "inline"`` (pyarrow missing when written), keep them on the line::

    {"kind":"step","step":12,"time":1712345678.5,"metrics":{"K/max":3.5,...},"ranks":{"K":[3.5,null],...}}

- ``metrics``: the aggregates of every per-rank key ``K`` (``K/max``, ``K/min``, ``K/mean``,
  ``K/max_rank`` and, since the catalogue's ``min_rank``, ``K/min_rank``; logs without it read alike).
  Ranks are JSON integers; logs written before that hold them as floats (``1.0``), read alike.
- ``ranks``: per-rank key -> one value per rank, in rank order; ``null`` where a rank lacks the key or
  its value is not finite (JSON has no NaN).

What the reader's fast path relies on (:func:`split_step`): a step line starts with
:data:`STEP_PREFIX`, its next field is ``"time"``, and ``ranks`` is the last field, so the line ends
with the per-rank object and ``}\\n``. The aggregates are a function of the per-rank vectors, so the
fast path skips them and parses the per-rank object alone (about half the line). A line in any other
layout (another writer, hand-edited) is still read, by a full ``json.loads``.
"""

from __future__ import annotations

import os
import re
from typing import Any

# The run directory's names are the run directory's (rankmem.core.rundir); here for the format's readers.
from rankmem.core.rundir import DETAIL_NAME as DETAIL_NAME
from rankmem.core.rundir import RUN_ID_FIELD as RUN_ID_FIELD
from rankmem.core.rundir import RUN_LOG_NAME as RUN_LOG_NAME
from rankmem.core.rundir import detail_name as detail_name

SCHEMA = 2
SUPPORTED_SCHEMAS = (1, 2)
INLINE = "inline"
"""The header's ``detail`` when the per-rank vectors are on the step lines (schema 1's layout)."""

# The side file's columns, one row per (collect, key): the collect's number in the log (0, 1, ...),
# its step and time, the key, the aggregates, and the per-rank values (a list of exactly world_size
# floats, null on collects that carried no per-rank detail: past the all-reduce crossover). NaN where a
# rank lacks the key or its value is not finite. The schema's metadata holds the world size. Within a
# batch the rows go key by key, then collect by collect (a reader copies a key's values as one block).
DETAIL_AGGREGATES = ("max", "min", "mean", "max_rank", "min_rank", "p50", "p90", "p99")
DETAIL_COLUMNS = ("collect", "step", "time", "key", *DETAIL_AGGREGATES, "ranks")
WORLD_KEY = b"rankmem.world_size"
"""The side file's schema metadata: the world size its per-rank lists are as long as."""
RUN_KEY = b"rankmem.run_id"
"""The side file's schema metadata: the run id of the log it belongs to (the header's ``run_id``)."""
LOG_OFFSET = b"rankmem.log_offset"
"""A batch's metadata: the run log's size in bytes after the line of the batch's last collect. A
reader takes the lines after the last whole batch's offset from the run log (aggregates only)."""

HEADER_KIND = "header"
STEP_KIND = "step"
STEP_FIELDS = ("kind", "step", "time", "metrics", "ranks")
SEPARATORS = (",", ":")
"""``json.dumps`` separators of every line: compact, which the fast path's markers assume."""

# The markers below are STEP_FIELDS written with SEPARATORS; tests/test_runlog_layout.py checks that
# the writer's lines hit them.
STEP_PREFIX = '{"kind":"step","step":'
TIME_FIELD = '"time":'
RANKS_MARK = ',"ranks":{'
STEP_MIN, STEP_MAX = -(2**63), 2**63 - 1
"""Steps are 64-bit integers: the reader holds them in an int64 array."""


_ROTATED = re.compile(r"\.[0-9]+")


def detail_path(log_path: str, name: str) -> str:
    """Where the side file ``name`` (the header's ``detail``) of the log at ``log_path`` is: its directory,
    with the log's rotation suffix (``rankmem.jsonl.2`` -> ``rankmem.ranks.arrow.2``; the writer
    rotates both together); a gzip'd log's side file is not compressed."""
    directory, base = os.path.split(log_path)
    if base.endswith(".gz"):
        base = base[: -len(".gz")]
    suffix = base.rsplit(".", 1)[-1] if "." in base else ""
    rotated = "." + suffix if _ROTATED.fullmatch("." + suffix) else ""
    return os.path.join(directory, os.path.basename(name) + rotated)


def step_object(step: int, time: float, metrics: dict[str, float], ranks: dict[str, Any] | None) -> dict[str, Any]:
    """A step line's object, its fields in :data:`STEP_FIELDS` order (a dict keeps insertion order);
    without ``ranks`` when the per-rank values go to the side file."""
    obj = {"kind": STEP_KIND, "step": step, "time": time, "metrics": metrics}
    if ranks is not None:
        obj["ranks"] = ranks
    return obj


# JSON's own number grammar: Python's int() and float() also take "1_0", " 7", "+7", "nan" and
# non-ASCII digits, which json.loads (the slow path) refuses; the two paths must read the same lines.
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def split_step(line: str) -> tuple[int, float, str] | None:
    """(step, time, the text of the per-rank object) of a step line in this layout, without parsing the
    aggregates; None for a line that visibly is not (another start, a truncated line, a null time).

    Cheap by design: a line whose ``ranks`` is not its last field yields text that is not one JSON
    object, and the caller's parse of it fails, which sends the line to the slow path just the same.
    """
    if not line.startswith(STEP_PREFIX) or not line.endswith("}\n"):
        return None
    cut = line.find(RANKS_MARK)  # a JSON string cannot hold it (its quotes would be escaped)
    if cut < 0 or line.find(STEP_PREFIX, 1, cut) > 0:
        # The second test: a torn line (a crash mid-write) with a whole one appended after it would
        # otherwise give the torn line's step with the whole line's per-rank values. (Torn after its
        # own ranks mark, the per-rank text holds two unclosed objects and fails to parse.)
        return None
    comma = line.find(",", len(STEP_PREFIX))
    head = line[len(STEP_PREFIX) : comma]
    rest = line[comma + 1 : line.find(",", comma + 1)]
    if not rest.startswith(TIME_FIELD):
        return None
    number = rest[len(TIME_FIELD) :]
    if not _JSON_INT.fullmatch(head) or not _JSON_NUMBER.fullmatch(number):
        return None  # a null time (not finite when written), or numbers json.loads would refuse
    return int(head), float(number), line[cut + len(RANKS_MARK) - 1 : -2]
