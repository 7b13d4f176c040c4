"""The reference worker as a Ray worker group, the way verl runs its workers.

- :mod:`rankmem.ray.group`: the driver's side: one actor per rank in a placement group, failures
  named by rank.
- :mod:`rankmem.ray.rank`: an actor that becomes one rank of a torch.distributed group.
- :mod:`rankmem.ray.actor`: the reference :class:`~rankmem.engine.worker.TrainingWorker` in such an actor.
- :mod:`rankmem.ray.cluster`: a local cluster or an existing one, and how many ranks fit in it.
- :mod:`rankmem.ray.launcher`: ``rankmem train --launcher ray``; :mod:`rankmem.ray.options` its flags.

For a Monitor inside your own Ray actors, see :mod:`rankmem.integrations.ray`. Importing this package
imports neither ray nor torch.
"""

from __future__ import annotations
