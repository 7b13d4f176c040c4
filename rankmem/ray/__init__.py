"""The reference worker as a Ray worker group, the way verl runs its workers.

- :mod:`rankmem.ray.group`: the driver's side: one actor per rank in a placement group, a rendezvous
  handed to every actor, methods called on all ranks and their results gathered (a failed or killed
  actor is named by rank).
- :mod:`rankmem.ray.rank`: the actor's side: an actor that becomes one rank of a torch.distributed group.
- :mod:`rankmem.ray.actor`: the reference :class:`~rankmem.engine.worker.TrainingWorker` in such an actor.
- :mod:`rankmem.ray.cluster`: a local cluster for the job or an existing one by address, and how many
  ranks fit in it.
- :mod:`rankmem.ray.launcher`: ``rankmem train --launcher ray``; :mod:`rankmem.ray.options` its flags.

For a Monitor inside your own Ray actors, see :mod:`rankmem.integrations.ray`.

Importing this package imports neither ray nor torch (the CLI builds its parser from
:mod:`rankmem.ray.options`); each module imports them where it needs them.
"""

from __future__ import annotations
