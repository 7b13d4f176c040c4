"""The memory model behind the advice: a phase's peak against the work of its heaviest micro-batch.

Pure numpy (no torch, no files), shared by the offline advice and anything online that wants it.
"""

from __future__ import annotations

from rankmem.fit.model import Fit, FitConfig, NoFit, fit_memory
from rankmem.fit.overhead import grew_pool, overhead_ratio
from rankmem.fit.pooled import fit_phase, prime, quadratic_across

__all__ = ["Fit", "FitConfig", "NoFit", "fit_memory", "fit_phase", "grew_pool", "overhead_ratio", "prime",
           "quadratic_across"]
