"""The ``mlflow`` sink: the aggregated keys as MLflow metrics, through ``MlflowClient`` (no global run).

Where it writes: ``tracking_uri`` if given, else ``MLFLOW_TRACKING_URI``, else a local store under the
run directory: ``sqlite:///<out_dir>/mlflow.db`` when SQLAlchemy is installed, otherwise the file
store ``<out_dir>/mlruns`` (mlflow-skinny ships no SQL backend). Read it back with
``mlflow ui --backend-store-uri <that URI>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import posixpath
import re
from typing import Any

from rankmem.core.records import RunHeader, StepRecord
from rankmem.errors import RankmemError

# MLflow's rules for metric names (mlflow.utils.validation): letters, digits and "_-. /:" only; at most
# MAX_KEY characters; and a name must be its own posixpath.normpath (no "//", no "." or ".." segment, no
# leading or trailing "/"). One bad key made MLflow refuse the whole batch, and SafeSink then dropped the
# sink for the run (issue 11): each key is made valid here instead.
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-. /:]")
MAX_KEY = 250
_BATCH = 1000  # MLflow's limit of metrics per log_batch call


def mlflow_key(key: str) -> str:
    """``key`` under MLflow's naming rules: bad characters become ``_``, empty and dot segments are
    dropped, and a name longer than :data:`MAX_KEY` keeps its head and a hash of the whole (so two long
    keys that share a head stay apart)."""
    name = _KEY_BAD.sub("_", key)
    if posixpath.normpath(name) != name or name.startswith(("/", ".")):
        parts = [p for p in name.split("/") if p not in ("", ".", "..")]
        name = "/".join(parts) or "_"
    if name.startswith(".."):  # MLflow refuses any name whose normpath starts with "..": "..x" too
        dots = len(name) - len(name.lstrip("."))
        name = "_" * dots + name[dots:]
    if len(name) > MAX_KEY:
        digest = hashlib.sha1(key.encode("utf-8", "replace")).hexdigest()[:10]
        name = name[: MAX_KEY - len(digest) - 1].rstrip("/") + "-" + digest
    return name


def local_tracking_uri(out_dir: str) -> str:
    """The local store for ``out_dir``: SQLite when SQLAlchemy is importable, else the file store."""
    out_dir = os.path.abspath(out_dir)
    if importlib.util.find_spec("sqlalchemy") is not None:
        return "sqlite:///" + os.path.join(out_dir, "mlflow.db")
    # MLflow 3 refuses the file store unless asked: it is the only store mlflow-skinny can write.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return "file://" + os.path.join(out_dir, "mlruns")


class MlflowSink:
    """Logs every finite aggregated key per step to one MLflow run (experiment ``rankmem`` by default)."""

    def __init__(
        self,
        out_dir: str | None = None,
        tracking_uri: str | None = None,
        experiment: str = "rankmem",
        run_name: str | None = None,
    ) -> None:
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None:
            if out_dir is None:
                raise RankmemError("the mlflow sink needs out_dir='runs/NAME' or MLFLOW_TRACKING_URI for its store")
            tracking_uri = local_tracking_uri(out_dir)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name or (os.path.basename(os.path.abspath(out_dir)) if out_dir else None)
        self.run_id: str | None = None
        self._client: Any = None
        self._keys: dict[str, str] = {}  # rankmem key -> its MLflow name, computed once per key

    def open(self, header: RunHeader) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        hosts = ",".join(sorted({r.host for r in header.ranks}))
        tags = {"rankmem.world_size": str(header.world_size), "rankmem.hosts": hosts[:5000]}
        run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self._client, self.run_id = client, run.info.run_id

    def write(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        ms = int(record.time * 1000)
        keys = self._keys
        metrics = []
        for k, v in record.metrics.items():
            if math.isfinite(v):
                name = keys.get(k)
                if name is None:
                    name = keys[k] = mlflow_key(k)
                metrics.append(Metric(name, v, ms, record.step))
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _BATCH])

    def close(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)
            self._client = None
