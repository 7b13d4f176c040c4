"""The run log writer: whatever the caller's config holds, and a restart, lose no records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import rankmem
from rankmem.offline import read_run


def _run(out: Path, **options: object) -> None:
    monitor = rankmem.Monitor(out_dir=str(out), device="cpu", children=False, **options)  # type: ignore[arg-type]
    for step in range(2):
        monitor.collect({"loss": float(step)}, step=step)
    monitor.close()


def test_config_with_paths_and_nan_keeps_the_header(tmp_path: Path) -> None:
    _run(tmp_path, run_config={"data": Path("/data/x"), "lr": math.nan})
    lines = (tmp_path / "rankmem.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["config"]["run"] == {"data": "/data/x", "lr": None}
    assert [json.loads(line)["step"] for line in lines[1:]] == [0, 1]


def test_a_restart_into_the_same_out_dir_keeps_the_earlier_log(tmp_path: Path) -> None:
    _run(tmp_path)
    first = (tmp_path / "rankmem.jsonl").read_text()
    with pytest.warns(RuntimeWarning,
                      match=r"was from an earlier run \(a restart into the same out_dir\?\); rotated it to "
                            r".*rankmem.jsonl.1"):
        _run(tmp_path)
    assert (tmp_path / "rankmem.jsonl.1").read_text() == first
    assert (tmp_path / "rankmem.jsonl").read_text().count("\n") == 3


def test_log_rank_outside_the_group_is_a_clear_error() -> None:
    monitor = rankmem.Monitor(log_rank=1, device="cpu", children=False)
    with pytest.raises(rankmem.RankmemError, match=r"log_rank=1 but the group has 1 rank\(s\): use 0..0"):
        monitor.collect()


def test_a_nan_metric_is_written_as_null(tmp_path: Path) -> None:
    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False)
    monitor.collect({"loss": math.nan, "lr": 0.5}, step=0)
    monitor.close()
    line = (tmp_path / "rankmem.jsonl").read_text().splitlines()[1]
    assert "NaN" not in line
    step = json.loads(line)
    assert step["metrics"]["loss/max"] is None and step["metrics"]["lr/max"] == 0.5
    assert "ranks" not in step  # the per-rank values are in the side file: NaN there, read back as NaN
    run = read_run(str(tmp_path))
    assert np.isnan(run.series["loss"]).all() and run.series["loss"].shape == (1, 1)
    assert run.series["lr"].tolist() == [[0.5]]


def test_ranks_are_json_integers(tmp_path: Path) -> None:
    from rankmem.offline import read_run

    monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False)
    monitor.collect({"loss": 1.5}, step=0)
    monitor.close()
    path = tmp_path / "rankmem.jsonl"
    header, line = path.read_text().splitlines()
    assert '"loss/max_rank":0,' in line and '"loss/min_rank":0,' in line
    metrics = json.loads(line)["metrics"]
    rank_keys = [k for k in metrics if k.endswith("_rank")]
    assert rank_keys and all(type(metrics[k]) is int for k in rank_keys)
    assert all(type(metrics[k]) is float for k in metrics if k.endswith("/max"))
    run = read_run(str(tmp_path), metrics=True)
    assert run.metrics is not None and run.metrics["loss/max_rank"].tolist() == [0.0]
    assert run.metrics["loss/max"].tolist() == [1.5] and run.series["loss"].tolist() == [[1.5]]
