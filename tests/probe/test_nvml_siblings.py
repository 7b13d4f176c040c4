"""Sibling ranks on a device, told apart from strangers by the job's heartbeats: a real torchrun job."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, torchrun

MIB = 2**20


def test_a_sibling_ranks_stray_context_is_a_sibling_not_a_stranger(tmp_path: Path) -> None:
    proc = torchrun(REPO / "tests/dist_scripts/nvml_siblings_worker.py", 2, [str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["split"]["siblings_bytes"] == 500 * MIB and rank0["split"]["foreign_bytes"] == 0
    assert rank1["split"]["siblings_bytes"] == 0 and rank1["split"]["foreign_bytes"] == 0
    assert rank0["split"]["reasons"] == {} == rank1["split"]["reasons"]
    assert rank0["siblings"] == [500 / 1024, 0.0]  # the per-rank key, as every rank gathered it
