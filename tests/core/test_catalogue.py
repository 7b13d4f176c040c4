"""The metric catalogue: docs/metrics.md's key table holds exactly its keys; what derives from it; the phase
of a peak."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rankmem.core import catalogue
from rankmem.core.catalogue import CATALOGUE, OUTSIDE_PHASES, PHASE_CATALOGUE, PHASE_PREFIX, phase_of_peak
from rankmem.core.records import PhaseBytes, WindowBytes
from tests.conftest import REPO

TABLE_HEAD = "| key | meaning | source |"


def _readme_keys() -> tuple[set[str], set[str]]:
    """(step-level keys, per-phase suffixes) named in the first column of README's metric table.

    A cell names one or more keys in backticks; ``.../suffix`` repeats the prefix of the first key in
    its cell, and ``mem/phase/P/suffix`` is phase ``P``'s key.
    """
    lines = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(TABLE_HEAD) + 2  # past the |---| row
    step_keys: set[str] = set()
    phase_suffixes: set[str] = set()
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        assert names, f"a metric table row without a key: {line}"
        prefix = names[0].rsplit("/", 1)[0]
        for name in names:
            key = prefix + name[3:] if name.startswith(".../") else name
            if key.startswith(PHASE_PREFIX):
                assert key.startswith(PHASE_PREFIX + "P/"), key
                phase_suffixes.add(key[len(PHASE_PREFIX + "P/") :])
            else:
                step_keys.add(key)
    return step_keys, phase_suffixes


def test_readme_metric_table_holds_exactly_the_catalogue() -> None:
    step_keys, phase_suffixes = _readme_keys()
    assert sorted(step_keys) == sorted(s.key for s in CATALOGUE)
    assert sorted(phase_suffixes) == sorted(s.key for s in PHASE_CATALOGUE)


def test_every_entry_is_made_from_a_record_field_in_its_unit() -> None:
    # A field or a derived property (``other``, ``headroom``) of the record.
    window_fields = {f.name for f in dataclasses.fields(WindowBytes)} | {
        n for n, v in vars(WindowBytes).items() if isinstance(v, property)}
    phase_fields = {f.name for f in dataclasses.fields(PhaseBytes)} | {
        n for n, v in vars(PhaseBytes).items() if isinstance(v, property)}
    assert len({s.key for s in CATALOGUE}) == len(CATALOGUE)
    assert len({s.field for s in CATALOGUE}) == len(CATALOGUE)
    for s in CATALOGUE:
        assert s.field in window_fields, s
        assert s.key.endswith("_gib") == (s.unit == "GiB"), s
        assert s.phase_suffix is None or s.phase_suffix in {p.key for p in PHASE_CATALOGUE}, s
    for p in PHASE_CATALOGUE:
        assert p.field in phase_fields and p.key.endswith("_gib") == (p.unit == "GiB"), p
        assert (p.unit == "count") == (p.field in catalogue.WORK_FIELDS), p
    for p in catalogue.PHASE_RISE_CATALOGUE:
        assert p.field in phase_fields and p.key.endswith("_gib") and p.unit == "GiB", p
    for s in CATALOGUE:  # every step peak with a phase counterpart knows the phase's rise to it
        assert (s.phase_suffix is None) == (s.rise_suffix is None), s
        assert s.rise_suffix is None or s.rise_suffix in {p.key for p in catalogue.PHASE_RISE_CATALOGUE}, s
    labels = [label for label, _ in catalogue.HEADLINE]
    assert len(set(labels)) == len(labels)


def test_derived_tables_and_directions() -> None:
    headroom = catalogue.key_of("headroom")
    assert headroom == "mem/device/headroom_gib"
    assert catalogue.worse(headroom) == "low" and catalogue.worst_stat(headroom) == "min"
    assert set(catalogue.LOW_IS_BAD) == {headroom, catalogue.key_of("node_available")}
    assert catalogue.worse("loss") == "high" and catalogue.worst_stat("loss") == "max"  # the caller's own keys
    assert catalogue.worst_stat(catalogue.key_of("peak_rss")) == "max"
    assert catalogue.LEAK_KEYS == ("mem/host/rss_gib", "mem/host/children_rss_gib",
                                   "mem/device/allocated_gib",
                                   "mem/device/engine_residue_gib")
    assert catalogue.PHASE_SUFFIX[catalogue.key_of("peak_reserved")] == "peak_reserved_gib"
    # A leak names its phase through the phase key that holds what each phase left of it behind.
    assert catalogue.PHASE_DELTA == {"mem/host/rss_gib": "rss_delta_gib",
                                     "mem/device/allocated_gib": "allocated_delta_gib"}
    assert set(catalogue.PHASE_DELTA.values()) <= {p.key for p in PHASE_CATALOGUE}
    assert "min_rank" in catalogue.AGGREGATES and "max_rank" in catalogue.AGGREGATES
    with pytest.raises(KeyError, match="no catalogue key is made from WindowBytes.nope"):
        catalogue.key_of("nope")
    assert catalogue.is_memory_key("mem/host/rss_gib")
    assert not catalogue.is_memory_key("mem/phase/update/peak_rss_gib") and not catalogue.is_memory_key("loss")
    assert catalogue.phase_key("update", "peak_rss_gib") == "mem/phase/update/peak_rss_gib"
    assert catalogue.phase_names(["mem/phase/b/x_gib", "mem/phase/a/y_gib", "mem/host/rss_gib", "mem/phase/"]) == ["a",
                                                                                                                   "b"]


def test_phase_of_peak_names_the_phase_that_equals_the_step_peak() -> None:
    rank_values: dict[str, float | None] = {
        "mem/host/peak_rss_gib": 2.0,
        "mem/phase/rollout/peak_rss_gib": 1.5,
        "mem/phase/update/peak_rss_gib": 2.0,
        "mem/phase/log_prob/peak_rss_gib": None,  # a phase this rank skipped
        "mem/phase/update/peak_allocated_gib": 2.5,  # another key's phase peak
    }
    assert phase_of_peak("mem/host/peak_rss_gib", 2.0, rank_values) == "update"
    assert phase_of_peak("mem/host/peak_rss_gib", 2.0 + 2**-20, rank_values) == OUTSIDE_PHASES  # 1 KiB above
    assert phase_of_peak("mem/device/peak_allocated_gib", 2.5, rank_values) == "update"
    assert phase_of_peak("mem/host/peak_rss_gib", 2.0, {"mem/host/peak_rss_gib": 2.0}) is None  # no phases
    assert phase_of_peak("mem/host/rss_gib", 2.0, rank_values) is None  # no phase counterpart


def test_rank_metrics_name_the_window_then_its_phases_in_gib() -> None:
    window = WindowBytes(rss=3 * 2**29, peak_rss=2**31)  # 1.5 GiB, 2 GiB; the rest unavailable
    phases = {"update": PhaseBytes(peak_rss=2**30, rss_delta=-(2**28))}
    assert catalogue.rank_metrics(window, phases) == {
        "mem/host/rss_gib": 1.5,
        "mem/host/peak_rss_gib": 2.0,
        "mem/phase/update/peak_rss_gib": 1.0,
        "mem/phase/update/rss_delta_gib": -0.25,
    }
