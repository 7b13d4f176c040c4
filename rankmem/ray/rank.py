"""The actor's side of a worker group: a Ray actor that becomes one rank of a torch.distributed group.

:class:`rankmem.ray.group.WorkerGroup` constructs each actor with its rank, the world size and its
local rank on its node, then asks rank 0 for a rendezvous address and hands it to every rank's
:meth:`RankActor.join`, as verl's ``RayWorkerGroup`` does with ``MASTER_ADDR``/``MASTER_PORT``.
Subclass it for your own actors; the methods the group calls are the ones here.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from rankmem.errors import RankmemError


class RankActor:
    """One rank. The constructor sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    in the actor's environment (what torchrun would set, and what rankmem's run log header reads)."""

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local_world_size))
        # One thread per rank unless the cluster says otherwise: actors share their node's cores.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def whereami(self) -> dict[str, str | int]:
        """This actor's rank, process and host, for the driver's messages."""
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on it now, for ``MASTER_ADDR``/``MASTER_PORT``. The port
        can be taken by another process before rank 0 binds it (torchrun --standalone has the same race)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return str(ray.util.get_node_ip_address()), port  # type: ignore[no-untyped-call]

    def join(self, master_addr: str, master_port: int, device_choice: str, timeout_s: float) -> str:
        """Join the group (a collective: every rank at once): NCCL on GPU, gloo on CPU, with a timeout,
        so a lost rank is an error rather than a hang. Returns the device this rank computes on."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        use_cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice == "cuda"
        if use_cuda and not torch.cuda.is_available():
            raise RankmemError("--device cuda, but this actor sees no CUDA device: give each actor a GPU "
                               "(--ray-gpus-per-actor 1) or use --device cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        if use_cuda:
            # Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU, which is then cuda:0; where it does
            # not (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), the local rank picks one.
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        return str(self.device)

    def flush_telemetry(self, timeout_s: float) -> bool:
        """Put every record this process's Monitors have queued on disk, within ``timeout_s``; False if
        that did not finish. :meth:`WorkerGroup.shutdown` calls it before it kills the actor:
        ``ray.kill`` ends the process at once, without its exit handlers."""
        from rankmem.publish.publisher import flush_all

        return flush_all(timeout_s)

    def leave(self) -> None:
        """Leave the group together (a collective): no collective is in flight when it goes."""
        import gc

        if dist.is_initialized():
            dist.barrier()
            gc.collect()  # FSDP2's DTensors hold the group: free them first (pytorch#179291)
            dist.destroy_process_group()
