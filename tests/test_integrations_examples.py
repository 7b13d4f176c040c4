"""README's integration snippets are the example files, and the verl example runs (HF and Lightning
examples run in their own tests under torchrun)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", re.S)


def test_readme_blocks_equal_example_files() -> None:
    blocks = BLOCK.findall((REPO / "README.md").read_text())
    assert {p for p, _ in blocks} >= {"examples/hf_example.py", "examples/lightning_example.py", "examples/verl_example.py"}
    for path, code in blocks:
        assert code == (REPO / path).read_text(), f"README block differs from {path}"


def test_verl_example_runs_on_two_ranks(run_torchrun: Any) -> None:
    proc = run_torchrun(REPO / "examples/verl_example.py", 2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    values = dict(line.split(": ") for line in proc.stdout.strip().splitlines())
    rss_max, rss_min = float(values["mem/host/rss_gib/max"]), float(values["mem/host/rss_gib/min"])
    assert abs((rss_max - rss_min) - 0.125) < 1 / 32  # rank 1 holds 128 MiB more, within 32 MiB
    assert rss_min <= float(values["perf/cpu_memory_used_gb"]) <= rss_max
    assert float(values["actor/pg_loss"]) == 0.625  # mean of [0.5, 0.25, 1.5, 0.25]
