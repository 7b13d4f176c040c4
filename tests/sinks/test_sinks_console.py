"""The console sink: each headline key at its worst end, with the rank that holds it."""

from __future__ import annotations

import io
import math

from rankmem.core.records import RankInfo, RunHeader, StepRecord
from rankmem.sinks._console import ConsoleSink, headline

RSS = "mem/host/rss_gib"
HEADROOM = "mem/device/headroom_gib"


def test_high_keys_show_the_max_and_low_keys_the_min_with_their_ranks() -> None:
    metrics = {
        f"{RSS}/max": 1.5, f"{RSS}/min": 1.0, f"{RSS}/max_rank": 3.0, f"{RSS}/min_rank": 0.0,
        f"{HEADROOM}/max": 9.0, f"{HEADROOM}/min": 0.25, f"{HEADROOM}/max_rank": 0.0, f"{HEADROOM}/min_rank": 2.0,
        "loss/max": 7.0, "loss/max_rank": 1.0,  # not a headline key
    }
    assert headline(metrics) == "rss=1.500GiB(r3) dev_headroom=0.250GiB(min,r2)"


def test_aggregates_without_min_rank_or_without_a_value_fall_back() -> None:
    # Records written before K/min_rank existed: the min, tagged, without a rank.
    assert headline({f"{HEADROOM}/min": 0.5, f"{HEADROOM}/max_rank": 1.0}) == "dev_headroom=0.500GiB(min)"
    # A key no rank had this window aggregates to NaN with rank -1: left out, not "nan".
    assert headline({f"{RSS}/max": math.nan, f"{RSS}/max_rank": -1.0}) == ""
    assert headline({f"{RSS}/max": 2.0}) == "rss=2.000GiB"
    assert headline({}) == ""


def test_sink_prints_header_and_one_line_per_step() -> None:
    out = io.StringIO()
    sink = ConsoleSink(stream=out)
    ranks = [RankInfo(rank=r, local_rank=r, host=f"node{r}", pid=1, device="none",
                      peak_rss_scope="window") for r in range(2)]
    sink.open(RunHeader(world_size=2, ranks=ranks, config={}, started=1.7e9))
    sink.write(StepRecord(step=4, time=1.7e9, metrics={f"{RSS}/max": 1.25, f"{RSS}/max_rank": 1.0}, ranks={}))
    sink.close()
    assert out.getvalue().splitlines() == ["[rankmem] world_size=2 hosts=node0,node1",
                                           "[rankmem] step 4 rss=1.250GiB(r1)"]
