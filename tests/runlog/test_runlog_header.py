"""The run header both ways: written by the real writer from a ``RunHeader``, read back by ``read_run``
(and ``watch``'s tail) into the same record; every class of damage to the header line gives its
field's default or one ``RankmemError`` naming the file and the field, and the steps are all read."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.core.version import __version__
from rankmem.errors import RankmemError
from rankmem.offline import read_run
from rankmem.offline.follow import Follower
from rankmem.runlog import RUN_LOG_NAME, RunLogWriter
from rankmem.runlog.layout import DETAIL_NAME

RUN_ID = "0123456789abcdef0123456789abcdef"[:16]
RANKS = [RankInfo(rank=0, local_rank=0, host="node0", pid=101, device="cuda NVIDIA H200", peak_rss_scope="window",
                  device_uuid="GPU-0000"),
         RankInfo(rank=1, local_rank=1, host="node0", pid=102, device="cuda NVIDIA H200", peak_rss_scope="edges")]
HEADER = RunHeader(world_size=2, ranks=RANKS, config={"lr": 0.5, "run": {"max_seq_len": 4096}}, started=1.75e9,
                   run_id=RUN_ID)
STEPS = 3


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _write(out: Path, header: RunHeader = HEADER) -> Path:
    writer = RunLogWriter(str(out / RUN_LOG_NAME))
    writer.open(header)
    for step in range(STEPS):
        writer.write(StepRecord(step=step, time=1.75e9 + step, metrics={"mem/host/rss_gib/max": 1.0 + step},
                                ranks={"mem/host/rss_gib": [1.0 + step, 0.5 + step]}))
    writer.close()
    return out / RUN_LOG_NAME


def test_the_header_reads_back_as_the_record_it_was_written_from(tmp_path: Path) -> None:
    torch_version = _torch_version()  # the header names the torch this process has loaded
    _write(tmp_path)
    run = read_run(str(tmp_path))
    assert isinstance(run.header, RunHeader)
    assert run.header == replace(HEADER, schema=3, detail=DETAIL_NAME, rankmem_version=__version__,
                                 torch_version=torch_version)
    assert run.header.ranks[0].device_uuid == "GPU-0000" and run.header.ranks[1].peak_rss_scope == "edges"
    assert run.header.extra == {} and run.header.unread == {}
    assert run.world_size == 2 and run.steps.tolist() == [0, 1, 2]
    assert run.series["mem/host/rss_gib"][:, 1].tolist() == [0.5, 1.5, 2.5]


def _damaged(tmp_path: Path, change: Any) -> Path:
    """The real writer's log with its header line's object changed by ``change`` (in place)."""
    path = _write(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    change(header)
    lines[0] = json.dumps(header) + "\n"  # json.dumps writes NaN as the token NaN, which json.loads reads
    path.write_text("".join(lines))
    return path


def _set(name: str, value: Any) -> Any:
    return lambda h: h.__setitem__(name, value)


def _drop(name: str) -> Any:
    return lambda h: h.pop(name)


def _rank_field(rank: int, name: str, value: Any) -> Any:
    return lambda h: h["ranks"][rank].__setitem__(name, value)


# (change, what the header then reads as): absent or wrong-typed fields get their defaults.
DEFAULTS = [
    pytest.param(_drop("started"), {"started": None}, id="missing started"),
    pytest.param(_drop("config"), {"config": {}}, id="missing config"),
    pytest.param(_drop("run_id"), {"run_id": None}, id="missing run_id"),
    pytest.param(_drop("torch"), {"torch_version": None}, id="missing torch"),
    pytest.param(_set("started", "yesterday"), {"started": None}, id="started a string"),
    pytest.param(_set("started", math.nan), {"started": None}, id="started NaN"),
    pytest.param(_set("started", math.inf), {"started": None}, id="started inf"),
    pytest.param(_set("config", [1, 2]), {"config": {}}, id="config a list"),
    pytest.param(_set("rankmem", 7), {"rankmem_version": None}, id="rankmem a number"),
    pytest.param(_set("run_id", "not hex"), {"run_id": None}, id="run_id not a run id"),
]


@pytest.mark.parametrize(("change", "expect"), DEFAULTS)
def test_a_damaged_header_field_reads_as_its_default_and_every_step_is_read(
        tmp_path: Path, change: Any, expect: dict[str, Any]) -> None:
    run = read_run(str(_damaged(tmp_path, change)))
    for name, value in expect.items():
        assert getattr(run.header, name) == value, name
    assert run.header.world_size == 2 and run.header.ranks == RANKS
    assert run.steps.tolist() == [0, 1, 2] and run.corrupt == 0


def test_a_wrong_typed_header_field_is_kept_as_read(tmp_path: Path) -> None:
    run = read_run(str(_damaged(tmp_path, lambda h: h.update(config=[1, 2], started="yesterday"))))
    assert run.header.unread == {"config": [1, 2], "started": "yesterday"}


def test_damaged_rank_entries_read_as_ranks_that_do_not_say(tmp_path: Path) -> None:
    def change(h: dict[str, Any]) -> None:
        h["ranks"][0]["pid"] = "101"
        del h["ranks"][0]["host"]
        h["ranks"][1] = "rank one"

    run = read_run(str(_damaged(tmp_path, change)))
    first, second = run.header.ranks
    assert first == replace(RANKS[0], pid=None, host="")
    assert second == RankInfo(rank=1, local_rank=None, host="", pid=None, device="", peak_rss_scope="")
    assert run.header.unread == {"ranks": {0: {"pid": "101"}, 1: "rank one"}}
    assert run.steps.tolist() == [0, 1, 2]


def test_fields_of_a_newer_writer_are_kept_and_the_log_reads(tmp_path: Path) -> None:
    run = read_run(str(_damaged(tmp_path, lambda h: h.update(nodes={"node0": [0, 1]}, schema_minor=3))))
    assert run.header.extra == {"nodes": {"node0": [0, 1]}, "schema_minor": 3}
    assert run.header.ranks == RANKS and run.steps.tolist() == [0, 1, 2]


# (change, what the one error names): the fields the arrays are shaped by must be right.
ERRORS = [
    pytest.param(_drop("world_size"), "the header's world_size must be the number of ranks", id="missing world_size"),
    pytest.param(_set("world_size", "two"), "the header's world_size must be the number of ranks",
                 id="world_size a string"),
    pytest.param(_set("world_size", math.nan), "the header's world_size must be the number of ranks",
                 id="world_size NaN"),
    pytest.param(_set("world_size", True), "the header's world_size must be the number of ranks",
                 id="world_size a bool"),
    pytest.param(_set("world_size", 3), "the header's world_size is 3 but it lists 2 ranks",
                 id="world_size not the ranks"),
    pytest.param(_set("ranks", {"0": {}}), "the header's 'ranks' must be a list", id="ranks an object"),
    pytest.param(_set("detail", 7), "the header's detail must name the per-rank file", id="detail a number"),
    pytest.param(_set("schema", 4), "has run log schema 4", id="schema from the future"),
    pytest.param(_set("schema", 2), "has run log schema 2", id="schema of an unreleased layout"),
    pytest.param(_drop("detail"), "the header's detail must name the per-rank file", id="missing detail"),
    pytest.param(_drop("schema"), "has run log schema None", id="missing schema"),
    pytest.param(_set("schema", True), "has run log schema True", id="schema a bool"),
]


@pytest.mark.parametrize(("change", "message"), ERRORS)
def test_a_damaged_shaping_field_is_one_error_naming_the_file_and_the_field(
        tmp_path: Path, change: Any, message: str) -> None:
    path = _damaged(tmp_path, change)
    with pytest.raises(RankmemError) as info:
        read_run(str(tmp_path))
    assert str(path) in str(info.value) and message in str(info.value)


def test_watch_follows_the_typed_header_and_names_a_damaged_one(tmp_path: Path) -> None:
    path = _write(tmp_path)
    tail = Follower(str(path)).poll()
    assert tail.header is not None and tail.header.ranks == RANKS and tail.header.run_id == RUN_ID
    assert tail.header_error is None
    (tmp_path / "damaged").mkdir()
    damaged_path = _damaged(tmp_path / "damaged", _set("world_size", "two"))
    damaged = Follower(str(damaged_path)).poll()
    assert damaged.header is None and damaged.header_error is not None
    assert "world_size" in str(damaged.header_error)

