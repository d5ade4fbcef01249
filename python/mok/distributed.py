"""Expert parallelism from a ``torch.distributed`` process group.

``expert_parallel_workspace(config, group)`` bootstraps mok's NCCL communicator from the group:
the group's first rank makes an NCCL unique id, every rank receives it through the group
(``broadcast_object_list``: any backend, gloo or nccl), and each process joins as its group rank
on its current CUDA device (one process per GPU, as torchrun starts them). mok's extension uses
the NCCL library that PyTorch loaded (one NCCL per process). A group of one takes the same path:
the expert-parallel layer with its exchange through its own peer pointers.

Every rank must make the same calls in the same order (each forward and backward signals and
waits for the other ranks, with a timeout and a diagnosis if one never comes), with the same
number of tokens per rank; each holds num_experts / group size experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C
from ._workspace import Workspace

__all__ = ["expert_parallel_workspace", "MIN_NCCL_VERSION"]

# ncclCommWindowRegister with symmetric windows and the device API's LSA pointers.
MIN_NCCL_VERSION = (2, 28, 0)


def _check_nccl() -> None:
    if not _C.has_nccl:
        raise NotImplementedError(
            "mok was built without NCCL (set MOK_NCCL_HOME, or install the CUDA toolkit's NCCL, "
            "and reinstall): expert parallelism is not available"
        )
    loaded = tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    if loaded is not None and loaded < MIN_NCCL_VERSION:
        raise RuntimeError(
            f"PyTorch loaded NCCL {'.'.join(map(str, loaded))}; mok's expert-parallel layer needs "
            f"NCCL {'.'.join(map(str, MIN_NCCL_VERSION))} or newer (one NCCL per process: upgrade "
            "the nvidia-nccl package PyTorch uses)"
        )


def expert_parallel_workspace(
    config: _C.MoeConfig, group, expected: tuple[int, int, int] | None = None
) -> Workspace:
    """A workspace whose layers are the expert-parallel layer's ranks over `group` (collective:
    every rank of the group calls it)."""
    if not dist.is_initialized():
        raise RuntimeError("mok: torch.distributed is not initialized (dist.init_process_group)")
    if not torch.cuda.is_available():
        raise RuntimeError("mok: expert parallelism needs a CUDA device per process")
    _check_nccl()
    rank = dist.get_rank(group=group)
    size = dist.get_world_size(group=group)
    device = torch.cuda.current_device()
    payload = [_C.make_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(payload, group=group, group_src=0)
    communicator = _C.Communicator.create_rank(payload[0], size, rank, device)
    return Workspace(config, communicator=communicator, num_ranks=size, expected=expected)
