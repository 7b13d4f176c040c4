"""The run log's line layout: defined once here, followed by the writer, relied on by the reader.

A run log is JSON Lines, one whole line per write. Line 1 is the header (``"kind": "header"``,
``"schema"``, versions, world size, per-rank host and device, config). Every other line is a step,
written compactly (no spaces) with its fields in :data:`STEP_FIELDS` order::

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

import re
from typing import Any

SCHEMA = 1
SUPPORTED_SCHEMAS = (1,)
RUN_LOG_NAME = "rankmem.jsonl"

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


def step_object(step: int, time: float, metrics: dict[str, float], ranks: dict[str, Any]) -> dict[str, Any]:
    """A step line's object, its fields in :data:`STEP_FIELDS` order (a dict keeps insertion order)."""
    return {"kind": STEP_KIND, "step": step, "time": time, "metrics": metrics, "ranks": ranks}


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
