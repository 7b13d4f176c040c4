"""The run log writer: whatever the caller's config holds, and a restart, lose no records."""

from __future__ import annotations

import enum
import json
import math
import warnings
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


class Split(enum.Enum):
    TRAIN = "train"


class BadStr:
    def __str__(self) -> str:
        raise RuntimeError("no text")


class BadItems(dict):  # type: ignore[type-arg]
    def items(self):  # type: ignore[no-untyped-def,override]
        raise RuntimeError("no items")


def _configs() -> dict[str, tuple[dict[object, object], dict[str, object]]]:
    """Configs users pass, and what the header must hold for a part of each (the rest kept as given)."""
    cyclic: dict[str, object] = {"lr": 0.1}
    cyclic["self"] = cyclic
    files = [f"/data/shard-{i:07d}.parquet" for i in range(200_000)]
    weights = dict(zip(*np.unique(np.array([3, 1, 3, 7]), return_counts=True), strict=True))  # numpy-int keys
    return {
        "numpy, tuple and Enum keys": ({"weights": weights, (1, 2): "pair", Split.TRAIN: 0.5, "lr": 0.1},
                                       {"weights": {"1": 1, "3": 2, "7": 1}, "(1, 2)": "pair", "Split.TRAIN": 0.5}),
        "a cycle": (cyclic, {"self": "<cycle>"}),
        "keys equal as text": ({1: "int", "1": "str", "lr": 0.1}, {"1": "int", "1 <str>": "str"}),
        "a key whose str raises": ({BadStr(): 1, "lr": 0.1}, {"<not encodable: a BadStr key>": 1}),
        "a mapping whose items raise": ({"inner": BadItems(a=1), "lr": 0.1}, {"inner": "<not encodable: BadItems>"}),
        "an int JSON cannot write": ({"seed": 10**5000, "lr": 0.1},
                                     {"seed": "<not encodable: an int of over 3,000 digits>"}),
        "200k file names (over 4 MiB)": ({"files": files, "lr": 0.1},
                                         {"files": f"<not encodable: {len(json.dumps(files))} bytes of JSON>"}),
    }


@pytest.mark.parametrize("case", list(_configs()))
def test_a_config_json_cannot_hold_costs_no_record_and_says_so_once(tmp_path: Path, case: str) -> None:
    """Keys made text say nothing; a marker or a renamed key is said in one warning."""
    config, expected = _configs()[case]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, run_config=config)
    said = [str(w.message) for w in warned if "run_config" in str(w.message)]
    assert len(said) == (0 if case.startswith("numpy") else 1), said
    assert all("run_config holds what the run log's header cannot keep as it is" in s for s in said)
    for step in range(20):
        monitor.collect({"loss": float(step)}, step=step)
    monitor.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == list(range(20))
    held = run.header.config["run"]
    assert {k: held[k] for k in expected} == expected and held["lr"] == 0.1


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


def test_a_config_of_many_small_values_over_the_bound_is_one_marker(tmp_path: Path) -> None:
    """No value over 64 KiB to give way (50k shard names): the whole config is the marker, the run logged."""
    config = {f"shard{i}": "x" * 100 for i in range(50_000)}
    with pytest.warns(RuntimeWarning, match=r"run_config \(\d+ bytes of JSON: the header keeps 4194304 at most\)"):
        monitor = rankmem.Monitor(out_dir=str(tmp_path), device="cpu", children=False, run_config=config)
    monitor.collect({"loss": 1.0}, step=0)
    monitor.close()
    run = read_run(str(tmp_path))
    assert run.steps.tolist() == [0]
    assert run.header.config["run"] == f"<not encodable: {len(json.dumps(config))} bytes of JSON>"
