"""Build multi-rank run logs with known values, through the real writer (no torchrun needed), and the
noisy memory series the leak tests feed them."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.exchange.aggregate import aggregate
from rankmem.offline import read_run
from rankmem.runlog import RUN_LOG_NAME, RunLogWriter


def write_run(
    out_dir: str | os.PathLike[str],
    series: Mapping[str, np.ndarray],
    steps: np.ndarray | None = None,
    world: int | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``series`` (key -> steps x ranks array, GiB; nan = absent) as a run log; returns its path."""
    first = next(iter(series.values()))
    n, w = first.shape
    world = world or w
    steps = np.arange(n) if steps is None else steps
    keys = sorted(series)
    header = RunHeader(
        world_size=world,
        ranks=[RankInfo(rank=r, local_rank=r, host="node0", pid=1000 + r, device="none",
                        peak_rss_scope="window") for r in range(world)],
        config=dict(config) if config is not None else {"test": True},
        started=1.7e9,
    )
    path = Path(out_dir) / RUN_LOG_NAME
    writer = RunLogWriter(str(path))
    writer.open(header)
    for i in range(n):
        matrix = np.column_stack([series[k][i] for k in keys])  # ranks x keys
        writer.write(StepRecord(step=int(steps[i]), time=1.7e9 + i, metrics=aggregate(keys, matrix), keys=keys,
                                matrix=matrix))
    writer.close()
    return path


MIB_IN_GIB = 1 / 1024


def noisy(n: int, world: int, seed: int) -> np.ndarray:
    """A 20 GiB baseline with 15 MiB white noise, a slow 10 MiB AR(1) wander and a few 300 MiB spikes."""
    rng = np.random.default_rng(seed)
    out = 20.0 + rng.normal(0, 15, (n, world)) * MIB_IN_GIB
    wander = np.zeros((n, world))
    for i in range(1, n):
        wander[i] = 0.95 * wander[i - 1] + rng.normal(0, 3, world)
    out += wander * MIB_IN_GIB
    spikes = rng.random((n, world)) < 0.01
    return out + spikes * 300 * MIB_IN_GIB


KNOWN_STEPS, KNOWN_WORLD = 40, 4
# known_run's leak: 8 MiB/step under 4 MiB noise, judged on the last 20 steps: the slope lands within ~0.5 of 8.
KNOWN_LEAK_LINE = (
    r"LEAK rank {rank} mem/host/rss_gib: \+(7\.[5-9]|8\.[0-4])\d\d MiB/step \(95% CI \+\d\.\d+\.\.\+\d\.\d+, "
    r"p=\d\.\de-\d+\), \+1[45]\d\.\d MiB over steps 20\.\.39; grew \+1[45]\d\.\d MiB from step 2\d to 3\d, "
    r"still growing"
)


def known_run(out: Path, leak_rank: int | None = None) -> Path:
    """4 ranks, 40 steps. Rank 2 holds the most (its update phase peaks at 4.5 GiB on step 7); rank 1 has
    the least device headroom (0.25 GiB on step 3)."""
    rng = np.random.default_rng(7)
    rss = np.array([1.0, 1.0, 3.0, 1.0]) + rng.normal(0, 4, (KNOWN_STEPS, KNOWN_WORLD)) * MIB_IN_GIB
    if leak_rank is not None:
        rss[:, leak_rank] += np.arange(KNOWN_STEPS) * 8 * MIB_IN_GIB  # 8 MiB/step
    rollout = rss + 0.5
    update = rss + 0.25
    update[7, 2] = 4.5
    peak = np.maximum(rollout, update)
    headroom = np.full((KNOWN_STEPS, KNOWN_WORLD), 10.0)
    headroom[3, 1] = 0.25
    return write_run(out, {
        "mem/host/rss_gib": rss,
        "mem/host/peak_rss_gib": peak,
        "mem/phase/rollout/peak_rss_gib": rollout,
        "mem/phase/update/peak_rss_gib": update,
        "mem/device/headroom_gib": headroom,
    })


def read_log(out: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run directory's header and step lines as JSON, each step with its ``ranks`` (key -> per-rank
    values, None where absent) from the side file through the reader, matched by step. Tests compare
    the two files' figures through it."""
    lines = (Path(out) / RUN_LOG_NAME).read_text().splitlines()
    header, steps = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    run = read_run(str(out))
    # A step number can repeat (a Trainer's final summary logs at the last step again): the side
    # file's rows of one step follow its lines in order.
    rows_of: dict[int, list[int]] = {}
    for i, number in enumerate(run.steps.tolist()):
        rows_of.setdefault(number, []).append(i)
    for step in steps:
        rows = rows_of.get(step["step"])
        i = rows.pop(0) if rows else None
        if i is not None:
            step["ranks"] = {k: [None if math.isnan(v) else v for v in m[i].tolist()]
                             for k, m in run.series.items() if not np.isnan(m[i]).all()}
    return header, steps


def run_with_events(tmp_path: Path, *lines: str) -> Path:
    """A two-rank run of five steps with ``lines`` as rank 0's event file."""
    write_run(tmp_path, {"mem/host/rss_gib": np.full((5, 2), 1.0)})
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank0.jsonl").write_text("".join(line + "\n" for line in lines))
    return tmp_path
