"""The ``prometheus`` sink's figures through ``ray.util.metrics``, for a Monitor inside a Ray actor.

Ray's metrics agent on each node already exports what actors record (KubeRay scrapes it), so this
opens no port: each family becomes a Ray ``Gauge`` of the same name (Ray's exporter prefixes ``ray_``),
set on the sink's thread at every record. Ray keeps a gauge's last value per tag set: a rank that
leaves the top-k keeps its last per-rank value there, where the HTTP endpoint drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankmem.sinks._promfigures import Family


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (Ray imported only where it is installed and initialised)."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None


class RayMetrics:
    """One Ray gauge per family, made at its first sample."""

    def __init__(self) -> None:
        self._gauges: dict[str, Any] = {}

    def publish(self, families: Sequence[Family]) -> None:
        from ray.util.metrics import Gauge

        for fam in families:
            name = fam.name + "_total" if fam.counter else fam.name  # the name the HTTP endpoint shows
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(name, description=fam.doc, tag_keys=fam.labels)
            for values, value in fam.samples:
                gauge.set(value, tags=dict(zip(fam.labels, values, strict=True)))
