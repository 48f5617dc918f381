"""Device selection and process-group setup for one SPMD program.

`python train.py` without torchrun is a world of one: it still gets a real
(in-process, port-free) process group so that meshes, FSDP2 and DCP behave the
same on one rank as on many.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.device import backend_for, pick_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 600.0, force_cpu: bool = False) -> DistInfo:
    """Join the torchrun job (env:// rendezvous) or make a world of one.

    Safe to call twice: a second call returns the existing world.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank, force_cpu=force_cpu)
    backend = backend_for(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # In-process store: no port is opened for a world of one.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            kwargs = {"device_id": device} if device.type != "cpu" else {}
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:
                kwargs.update(
                    store=_attempt_store(timeout), rank=int(os.environ["RANK"]), world_size=world
                )
            dist.init_process_group(backend, timeout=timeout, **kwargs)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size())))
    return DistInfo(
        dist.get_rank(), local_rank, dist.get_world_size(), device, backend, local_world
    )


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with keys scoped to this restart attempt.

    After ``--max-restarts`` relaunches the workers, the agent's store can
    still hold the previous attempt's keys; gloo then reads a dead peer's
    address and its full-mesh connect hangs or is refused (seen in a
    kill -9 drill). A prefix per attempt keeps every attempt's rendezvous its own.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        **({} if agent_store else {"multi_tenant": True}),
    )
    return dist.PrefixStore(f"tandem/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def destroy_distributed(barrier: bool = False) -> None:
    """Tear the process groups down while the interpreter is fully alive.

    ``barrier=True`` (a run that finished normally on every rank) waits for
    all ranks first, so no rank closes its connections while another still
    has work in flight; a failing run skips it, since its peers may be stuck
    in another collective. A garbage collection then frees any tensor held by
    a finished collective before interpreter finalisation.
    """
    if not dist.is_initialized():
        return
    if barrier and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except Exception:  # a peer already gone: nothing left to wait for
            pass
    import gc

    gc.collect()
    dist.destroy_process_group()
    gc.collect()
