"""mok.nn.MoE's parameters are ordinary nn.Parameters: DDP and FSDP2 (fully_shard) wrap the module
and train it like any other (a process group of one here, gloo on the CPU; the same gradients as
without the wrapper), FSDP2's mixed precision too (fp32 master weights, bf16 compute)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mok


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 128, generator=gen).to(torch.bfloat16)
    top = torch.randint(0, 8, (32, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(32, 2, generator=gen)
    return x, top, weights


def gradients(module, bf16_router_weights=False):
    x, top, weights = inputs()
    if bf16_router_weights:  # what FSDP2's mixed precision hands the module
        weights = weights.to(torch.bfloat16).float()
    module(x, top, weights).float().pow(2).mean().backward()
    return [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in module.parameters()
    ]


def fresh_module():
    torch.manual_seed(0)
    return mok.nn.MoE(8, 128, 128, shared_intermediate_size=64)


def test_ddp(group_of_one):
    expected = gradients(fresh_module())
    wrapped = torch.nn.parallel.DistributedDataParallel(fresh_module())
    got = gradients(wrapped)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_fsdp2_fully_shard(group_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    expected = gradients(fresh_module())
    module = fresh_module()
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    got = gradients(module)
    for a, b in zip(got, expected):
        assert torch.equal(a.to(b.dtype), b)


def test_fsdp2_mixed_precision_from_fp32_master_weights(group_of_one):
    """FSDP2's usual recipe: fp32 parameters, bf16 compute (MixedPrecisionPolicy casts the
    unsharded weights and every floating forward input, the router weights included, to bf16),
    fp32 gradient reduction. The gradients are the bf16 module's on the same bf16-rounded router
    weights, in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    expected = gradients(fresh_module(), bf16_router_weights=True)
    module = fresh_module().float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    got = gradients(module)
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        assert torch.equal(a, b.float())
