"""Expert parallelism under torchrun, one process per GPU (scripts/gpu-check.sh runs it with one
process, and with every GPU of the machine when it has several):

    torchrun --nproc_per_node=N tests/python/torchrun_expert_parallel.py

Each rank holds E / N experts of one model (the same seed everywhere) and its own tokens; its
output, d_x and d_router_weights must equal, bitwise, those of the single-GPU layer holding all E
experts on the same tokens, and two steps must give the same bits, as must the group with the
communication inside the GEMMs (MoKConfig.ep_dispatch_in_gemm). Prints PASS on rank 0 (exit 0),
or what differed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import mok

E, H, I, K, T = 16, 256, 128, 4, 96


def problem(rank: int, device):
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(E, I, H, generator=gen) * 0.05).to(torch.bfloat16),
        (torch.randn(E, I, H, generator=gen) * 0.05).to(torch.bfloat16),
        (torch.randn(E, H, I, generator=gen) * 0.05).to(torch.bfloat16),
    ]
    gen.manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    top = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    router = torch.rand(T, K, generator=gen)
    d_out = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    return weights, [t.to(device) for t in (x, top, router, d_out)]


def module_with(weights, experts, group, device, config=None):
    module = mok.nn.MoE(E, H, I, group=group, device=device, config=config)
    with torch.no_grad():
        for param, full in zip(module.parameters(), weights):
            param.copy_(full[experts])
    return module


def step(module, x, top, router, d_out):
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    router = router.clone().requires_grad_(True)
    out = module(x, top, router)
    out.backward(d_out)
    return [out.detach(), x.grad, router.grad]


def main() -> int:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    weights, inputs = problem(rank, device)
    per_rank = E // size
    grouped = module_with(
        weights, slice(rank * per_rank, (rank + 1) * per_rank), dist.group.WORLD, device
    )
    first = step(grouped, *inputs)
    again = step(grouped, *inputs)
    grouped.workspace.synchronize()
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    in_gemm_config = mok.MoKConfig(ep_dispatch_in_gemm=True)
    in_gemm = step(module_with(weights, mine, dist.group.WORLD, device, in_gemm_config), *inputs)
    alone = step(module_with(weights, slice(0, E), None, device), *inputs)
    failures = []
    names = ["out", "d_x", "d_router_weights"]
    for name, a, b, c, d in zip(names, first, again, alone, in_gemm):
        if not torch.equal(a, b):
            failures.append(f"rank {rank}: {name} differs between two steps")
        if not torch.equal(a, c):
            failures.append(f"rank {rank}: {name} differs from the single-GPU layer")
        if not torch.equal(a, d):
            failures.append(f"rank {rank}: {name} differs with the communication in the GEMMs")
    results = [None] * size
    dist.all_gather_object(results, failures)
    dist.destroy_process_group()
    if rank == 0:
        flat = [f for rank_failures in results for f in rank_failures]
        print("\n".join(flat) if flat else f"PASS: {size} process(es), bitwise")
        return 1 if flat else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
