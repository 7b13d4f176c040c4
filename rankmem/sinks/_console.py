"""The ``console`` sink: one compact line per logged step with the headline figures and worst ranks."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import IO

from rankmem.core.catalogue import HEADLINE
from rankmem.core.records import RunHeader, StepRecord
from rankmem.core.text import printable


def headline(metrics: Mapping[str, float]) -> str:
    """``label=VALUEGiB(rN)`` for each headline key present: the worst rank's value and that rank.

    The worst end is the catalogue's: the max for usage and peaks, the min (tagged ``min``) for
    headroom. Aggregates written before ``K/min_rank`` existed give the min without a rank.
    """
    parts = []
    for label, spec in HEADLINE:
        stat = spec.worst_stat()
        value = metrics.get(f"{spec.key}/{stat}")
        if value is None or not math.isfinite(value):  # NaN: no rank had the key this window
            continue
        rank = metrics.get(f"{spec.key}/{stat}_rank")
        tags = ["min"] if stat == "min" else []
        if rank is not None and math.isfinite(rank) and rank >= 0:
            tags.append(f"r{int(rank)}")
        unit = "GiB" if spec.unit == "GiB" else ""
        parts.append(f"{label}={value:.3f}{unit}" + (f"({','.join(tags)})" if tags else ""))
    return " ".join(parts)


class ConsoleSink:
    def __init__(self, out_dir: str | None = None, stream: IO[str] | None = None) -> None:
        self._stream = stream

    def open(self, header: RunHeader) -> None:
        hosts = sorted({r.host for r in header.ranks})
        hosts_text = printable(",".join(hosts))  # host names are whatever the ranks said: escaped
        print(f"[rankmem] world_size={header.world_size} hosts={hosts_text}", file=self._stream or sys.stdout)

    def write(self, record: StepRecord) -> None:
        print(printable(f"[rankmem] step {record.step} {headline(record.metrics)}"), file=self._stream or sys.stdout,
              flush=True)

    def close(self) -> None:
        pass
