"""The reference engine worker: a tiny GPT, generated data, and a verl-shaped ``TrainingWorker``.

Launched by ``torchrun`` through ``python -m rankmem.engine.train`` (or ``rankmem train``). Imports
torch; ``import rankmem`` alone does not import this package.
"""

from __future__ import annotations
