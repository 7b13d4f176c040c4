"""The offline layer: everything that reads a run directory after (or while) a job writes it.

Nothing online imports this package (``tests/test_layers.py`` holds that rule); none of it needs torch.

- :func:`read_run` -> :class:`Run`: the run log and its side file into numpy arrays (:mod:`.runlog`);
- :func:`read_events`: every rank's forensic events (:mod:`.events`);
- ``report``, ``leaks``, ``plot``, ``watch``, ``html``: what the CLI prints and draws from them.
"""

from __future__ import annotations

from rankmem.offline.events import Events, read_events
from rankmem.offline.runlog import Run, read_run, resolve_run_path

__all__ = ["Events", "Run", "read_events", "read_run", "resolve_run_path"]
