"""Process group and device mesh from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK).

One process per GPU: each process binds to ``cuda:LOCAL_RANK`` and talks NCCL; without a GPU the
processes talk gloo on the CPU. A single process (plain ``python train.py``) needs no process group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")

# The GPU hosts must never use NVLink SHARP / multicast: it hangs or corrupts collectives there.
# Set before any NCCL communicator exists, and only as defaults so a user can still see the knobs.
_HOST_RULES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in _HOST_RULES.items():
    os.environ.setdefault(_k, _v)


@dataclass
class DistState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment; (0, 1, 0) outside it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank if world > 1 else 0)))
    return rank, world, local


def local_device(local_rank: int | None = None, *, use_cpu: bool = False) -> torch.device:
    """``cuda:LOCAL_RANK`` when a GPU is visible, else the CPU."""
    if use_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = env_world()[2]
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise UnsupportedError(
            f"LOCAL_RANK={local_rank} but only {n} GPU(s) are visible; launch with "
            f"`torchrun --nproc_per_node={n}` or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


def init_distributed(*, use_cpu: bool = False, timeout_s: float | None = None) -> DistState:
    """Join the process group torchrun describes (idempotent); a single process gets a trivial state."""
    rank, world, local = env_world()
    device = local_device(local, use_cpu=use_cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return DistState(0, 1, 0, device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise UnsupportedError(f"WORLD_SIZE={world} but {key} is not set; launch with torchrun "
                                       "(`torchrun --nproc_per_node=N train.py`), which sets it")
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if timeout_s is not None:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
        if rank == 0:
            logger.info("process group: %s, %d processes, one per %s", backend, world, device.type)
    return DistState(dist.get_rank(), dist.get_world_size(), local, device)


def build_mesh(state: DistState, tp_size: int = 1):
    """A ("dp", "tp") DeviceMesh over all processes; tp is the fastest-varying (same host) dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    if state.world_size % tp_size:
        raise UnsupportedError(f"tp_size={tp_size} does not divide the {state.world_size} processes; "
                               "pick a tp_size that divides --nproc_per_node x nodes")
    return init_device_mesh(state.device.type, (state.world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
