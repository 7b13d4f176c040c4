"""``rankmem report``'s event lines name device memory by owner; an unknown part is ``?`` with its reason."""

from __future__ import annotations

from rankmem.core.events import NearOomEvent, OomEvent
from rankmem.offline.report import describe_event, owners_text

GIB = 2**30


def test_an_oom_event_line_names_each_owner_and_the_unknown_ones() -> None:
    table = {"reserved_bytes": 2 * GIB, "nontorch_bytes": GIB // 2, "siblings_bytes": 0, "descendants_bytes": None,
             "foreign_bytes": None, "unattributed_bytes": GIB,
             "reasons": {"descendants": "NVML_VALUE_NOT_AVAILABLE for pid 7",
                         "foreign": "NVML_VALUE_NOT_AVAILABLE for pid 7"}}
    event = OomEvent(rank=1, step=3, phase="update", where="device", error="OutOfMemoryError: x",
                     device={"free_bytes": 0, "total_bytes": 4 * GIB, "attribution": table})
    assert describe_event(event) == (
        "oom rank 1 step 3 phase update: device OutOfMemoryError: x; device free 0.000 of 4.000 GiB; device by "
        "owner (GiB): reserved 2.000, nontorch 0.500, siblings 0.000, descendants ?, foreign ?, unattributed 1.000 "
        "(unknown: NVML_VALUE_NOT_AVAILABLE for pid 7)")


def test_no_table_no_text_and_foreign_types_are_unknown() -> None:
    assert owners_text(None) == ""
    assert owners_text({"reserved_bytes": "12", "reasons": []}).startswith("; device by owner (GiB): reserved ?")
    near = NearOomEvent(rank=0, step=1, phase=None, reasons=("node available low",),
                        device={"attribution": {"reserved_bytes": GIB, "reasons": {}}})
    assert describe_event(near).startswith("near_oom rank 0 step 1 phase -: node available low; device by owner")
