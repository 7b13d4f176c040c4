"""The memory model behind the advice, pure numpy: ``model`` (a rank's fit), ``pooled`` (the ranks'
shared slopes), ``series`` and ``capacity`` (a run's arrays to a verdict). No module is imported here."""

HEADROOM_FRACTION = 0.05  # here, not in capacity: `rankmem advise --help` shows it and loads no numpy
"""The headroom kept under the capacity where none is asked for."""
