"""The ``console`` sink: one compact line per logged step with the headline figures and worst ranks."""

from __future__ import annotations

import sys
from typing import IO

from rankmem._records import RunHeader, StepRecord

# (label, per-rank key): the figures that say who is close to running out.
HEADLINE = (
    ("rss", "mem/host/rss_gib"),
    ("peak_rss", "mem/host/peak_rss_gib"),
    ("children", "mem/host/children_rss_gib"),
    ("dev_peak_res", "mem/device/peak_reserved_gib"),
    ("dev_headroom", "mem/device/headroom_gib"),
)


def headline(metrics: dict[str, float]) -> str:
    """``label=max GiB (rN)`` for each headline key present: the worst rank's value and its rank."""
    parts = []
    for label, key in HEADLINE:
        # Headroom is worst at its minimum; the max rank of the others is the one nearest OOM.
        if key.endswith("headroom_gib"):
            value = metrics.get(key + "/min")
            parts.append(f"{label}={value:.3f}GiB(min)" if value is not None else "")
            continue
        value, rank = metrics.get(key + "/max"), metrics.get(key + "/max_rank")
        if value is not None and rank is not None:
            parts.append(f"{label}={value:.3f}GiB(r{int(rank)})")
    return " ".join(p for p in parts if p)


class ConsoleSink:
    def __init__(self, out_dir: str | None = None, stream: IO[str] | None = None) -> None:
        self._stream = stream

    def open(self, header: RunHeader) -> None:
        hosts = sorted({r.host for r in header.ranks})
        print(f"[rankmem] world_size={header.world_size} hosts={','.join(hosts)}", file=self._stream or sys.stdout)

    def write(self, record: StepRecord) -> None:
        print(f"[rankmem] step {record.step} {headline(record.metrics)}", file=self._stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass
