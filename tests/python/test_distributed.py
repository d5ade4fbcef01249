"""Expert parallelism from a torch.distributed process group (mok.distributed): the group of one
on one GPU takes the same path as a real group (the expert-parallel layer, its NCCL communicator
bootstrapped through the group) and agrees with the single-GPU layer; two processes on two GPUs
(where the machine has them) split the experts and agree with one GPU holding them all; both
bitwise reproducible. Without CUDA the bootstrap refuses with a message."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mok
from conftest import cuda_reason
from mok.distributed import expert_parallel_workspace

E, H, I, K, T = 8, 128, 128, 2, 64


def init_group(rank: int, size: int, store_path: str) -> None:
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)


def full_problem(seed=0):
    """The whole group's weights and every rank's tokens (CPU), the same on every process."""
    gen = torch.Generator().manual_seed(seed)
    weights = [
        (torch.randn(E, I, H, generator=gen) * 0.05).to(torch.bfloat16),
        (torch.randn(E, I, H, generator=gen) * 0.05).to(torch.bfloat16),
        (torch.randn(E, H, I, generator=gen) * 0.05).to(torch.bfloat16),
    ]
    x = torch.randn(2, T, H, generator=gen).to(torch.bfloat16)
    top = torch.randint(0, E, (2, T, K), generator=gen, dtype=torch.int32)
    router = torch.rand(2, T, K, generator=gen)
    d_out = torch.randn(2, T, H, generator=gen).to(torch.bfloat16)
    return weights, x, top, router, d_out


def run_module(module, x, top, router, d_out):
    x = x.clone().requires_grad_(True)
    router = router.clone().requires_grad_(True)
    out = module(x, top, router)
    out.backward(d_out)
    return [out.detach(), x.grad, router.grad] + [p.grad for p in module.parameters()]


def module_with(weights, expert_slice, group, device):
    module = mok.nn.MoE(E, H, I, group=group, device=device)
    with torch.no_grad():
        for param, full in zip(module.parameters(), weights):
            param.copy_(full[expert_slice])
    return module


@pytest.mark.skipif(cuda_reason() is None, reason="this machine has a GPU: the CUDA test covers it")
def test_bootstrap_without_cuda_says_why(tmp_path):
    init_group(0, 1, str(tmp_path / "store"))
    try:
        with pytest.raises(RuntimeError, match="CUDA device"):
            expert_parallel_workspace(mok.MoKConfig().to_native(), dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
def test_group_of_one_matches_the_single_gpu_layer(tmp_path):
    init_group(0, 1, str(tmp_path / "store"))
    try:
        weights, x, top, router, d_out = full_problem()
        args = [t.cuda() for t in (x[0], top[0], router[0], d_out[0])]
        grouped = module_with(weights, slice(0, E), dist.group.WORLD, "cuda")
        single = module_with(weights, slice(0, E), None, "cuda")
        first = run_module(grouped, *args)
        for p in grouped.parameters():
            p.grad = None
        again = run_module(grouped, *args)
        alone = run_module(single, *args)
        grouped.workspace.synchronize()
        for a, b, c in zip(first, again, alone):
            assert torch.equal(a, b)
            assert torch.equal(a, c)
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, store_path: str, result_path: str) -> None:
    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    init_group(rank, 2, store_path)
    weights, x, top, router, d_out = full_problem()
    local = slice(rank * E // 2, (rank + 1) * E // 2)
    module = module_with(weights, local, dist.group.WORLD, f"cuda:{rank}")
    args = [t.cuda(rank) for t in (x[rank], top[rank], router[rank], d_out[rank])]
    first = run_module(module, *args)
    for p in module.parameters():
        p.grad = None
    again = run_module(module, *args)
    module.workspace.synchronize()
    torch.save(
        {"first": [t.cpu() for t in first], "again": [t.cpu() for t in again]},
        f"{result_path}.{rank}",
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(
    cuda_reason() is not None or torch.cuda.device_count() < 2,
    reason=str(cuda_reason() or "one GPU here: the 2-process group needs two"),
)
def test_two_processes_split_the_experts(tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), str(tmp_path / "result")), nprocs=2)
    weights, x, top, router, d_out = full_problem()
    single = module_with(weights, slice(0, E), None, "cuda:0")
    for rank in range(2):
        result = torch.load(f"{tmp_path / 'result'}.{rank}")
        for a, b in zip(result["first"], result["again"]):
            assert torch.equal(a, b)
        expected = run_module(
            single, *[t.cuda(0) for t in (x[rank], top[rank], router[rank], d_out[rank])]
        )
        # The output and the activation gradients of this rank's tokens (its weight gradients sum
        # both ranks' tokens, which the single layer here sees one rank at a time).
        for got, want in zip(result["first"][:3], expected[:3]):
            assert torch.equal(got, want.cpu())
        for p in single.parameters():
            p.grad = None
