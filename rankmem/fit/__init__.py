"""The memory model behind the advice: a phase's peak against the work of its heaviest micro-batch.

Pure numpy (no torch, no files): :mod:`~rankmem.fit.model` (one rank's fit), :mod:`~rankmem.fit.pooled`
(the ranks' shared slopes), :mod:`~rankmem.fit.series` and :mod:`~rankmem.fit.capacity` (from a run's
arrays to a verdict). No module is imported here: ``rankmem advise --help`` loads no numpy.
"""

HEADROOM_FRACTION = 0.05  # here, not in capacity: `rankmem advise --help` shows it
"""The headroom kept under the capacity where none is asked for."""
