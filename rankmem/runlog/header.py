"""The run log's header line, both ways: a :class:`~rankmem.core.records.RunHeader` into the line's
object (:func:`header_to_json`, the writer's) and the object back into the record
(:func:`header_from_json`, the readers').

The file is untrusted when read. What the per-rank arrays are shaped by (``schema``, ``world_size``,
``ranks`` as a list as long as the world, ``detail``) must be right: anything else is one
:class:`~rankmem.errors.RankmemError` naming the file and the field. Every other field that is absent,
``null`` or of the wrong type (a NaN ``started``, a ``config`` that is a list, a rank entry that is a
string) gets its default, its value kept in ``RunHeader.unread``; fields a newer writer adds go to
``RunHeader.extra``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from rankmem.core.records import RankInfo, RunHeader
from rankmem.core.rundir import valid_run_id
from rankmem.core.untrusted import Fields, as_float, as_int, as_object, as_str
from rankmem.errors import RankmemError
from rankmem.runlog.layout import DETAIL_NAME, HEADER_KIND, RUN_ID_FIELD, SCHEMA, SUPPORTED_SCHEMAS

MAX_WORLD = 1 << 20
"""Most ranks a header may claim without listing them: past any cluster, short of gigabytes per key."""


def header_to_json(header: RunHeader, detail: str = DETAIL_NAME) -> dict[str, Any]:
    """The header line's object: this process's versions and schema, ``detail`` the side file's name."""
    from rankmem.core.version import __version__

    torch = sys.modules.get("torch")  # never imported here: torch takes seconds to load, on the sink thread
    return {"kind": HEADER_KIND, "schema": SCHEMA, "rankmem": __version__,
            "torch": str(torch.__version__) if torch is not None else None, "world_size": header.world_size,
            "started": header.started, "ranks": [asdict(r) for r in header.ranks], "config": header.config,
            "detail": detail, RUN_ID_FIELD: header.run_id}


def short(value: Any) -> str:
    """``repr(value)``, cut to a line (a damaged field can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + f"... ({len(text)} characters)"


def header_from_json(obj: Mapping[str, Any], path: str) -> RunHeader:
    """The :class:`RunHeader` of a header line's object (its ``kind`` already checked by the caller)."""
    schema = obj.get("schema")
    if isinstance(schema, bool) or schema not in SUPPORTED_SCHEMAS:
        supported = ", ".join(str(s) for s in SUPPORTED_SCHEMAS)
        raise RankmemError(f"{path} has run log schema {short(schema)}; this rankmem reads schema {supported}: "
                           "read it with the rankmem version that wrote it (see the header's 'rankmem' field)")
    world = _world_size(obj, path)
    detail = obj.get("detail")
    if not isinstance(detail, str) or not detail:
        raise RankmemError(f"{path}: the header's detail must name the per-rank file, got {short(detail)}; "
                           "the header is damaged")
    read = Fields(obj)
    read.skip("kind", "schema", "world_size", "detail", "ranks", RUN_ID_FIELD)
    ranks, unread_ranks = _ranks(obj.get("ranks"))
    header = RunHeader(world_size=world, ranks=ranks, config=read.take("config", as_object, {}),
                       started=read.optional("started", as_float), run_id=valid_run_id(obj.get(RUN_ID_FIELD)),
                       schema=int(schema), detail=detail, rankmem_version=read.optional("rankmem", as_str),
                       torch_version=read.optional("torch", as_str), extra=read.extra(), unread=read.unread)
    if unread_ranks:
        header.unread["ranks"] = unread_ranks
    return header


def _world_size(obj: Mapping[str, Any], path: str) -> int:
    """The header's ``world_size``, checked: every row of every series is that wide."""
    world, ranks = obj.get("world_size"), obj.get("ranks")
    if "ranks" in obj and not isinstance(ranks, list):  # absent is fine (another writer); null is not
        raise RankmemError(f"{path}: the header's 'ranks' must be a list of per-rank records, got {short(ranks)}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise RankmemError(f"{path}: the header's world_size must be the number of ranks (an integer >= 1), "
                           f"got {short(world)}; the header is damaged")
    if ranks and len(ranks) != world:
        raise RankmemError(f"{path}: the header's world_size is {short(world)} but it lists {len(ranks)} ranks; "
                           "the header is damaged")
    if world > MAX_WORLD and not ranks:
        raise RankmemError(f"{path}: the header's world_size {short(world)} is more than {MAX_WORLD} ranks; "
                           "the header is damaged")
    return world


def _ranks(raw: Any) -> tuple[list[RankInfo], dict[int, Any]]:
    """The per-rank records in list order, and (by position) what could not be read of them."""
    out, unread = [], {}
    for i, entry in enumerate(raw if isinstance(raw, list) else []):
        read = Fields(entry if isinstance(entry, dict) else {})
        out.append(RankInfo(rank=read.take("rank", as_int, i), local_rank=read.optional("local_rank", as_int),
                            host=read.take("host", as_str, ""), pid=read.optional("pid", as_int),
                            device=read.take("device", as_str, ""),
                            peak_rss_scope=read.take("peak_rss_scope", as_str, ""),
                            device_uuid=read.optional("device_uuid", as_str)))
        if not isinstance(entry, dict):
            unread[i] = entry
        elif read.unread:
            unread[i] = read.unread
    return out, unread
