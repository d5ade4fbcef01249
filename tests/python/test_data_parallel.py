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


def test_fsdp2_fp8_quantizes_the_weights_every_call(group_of_one, monkeypatch):
    """Why FP8 keeps no quantized weights by default (Workspace.weights_version 0): FSDP2's
    unsharding writes each step's new values into the same unsharded tensor without advancing
    its version counter, so "auto" names the weights of two optimizer steps alike (a canary: if
    a torch upgrade makes this assert fail, "auto" may have become safe under FSDP2). The
    default gives version 0 at every call: quantize every time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mok import ops

    # The version is computed for CUDA calls; on a machine without a GPU, no stream captures.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    torch.manual_seed(0)
    module = mok.nn.MoE(8, 128, 128, config=mok.MoKConfig(precision="fp8_block"))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    space = module.workspace
    seen = []

    def record(mod, args):  # after FSDP2's own pre-forward hook: the weights are unsharded
        weights = (mod.w_gate, mod.w_up, mod.w_down)
        default = ops._weights_version(space, weights)
        space.weights_version = "auto"
        auto = ops._weights_version(space, weights)
        space.weights_version = 0
        seen.append((default, auto, mod.w_gate.detach().clone()))

    module.register_forward_pre_hook(record)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x, top, weights = inputs()
    for _ in range(2):
        module(x, top, weights).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    (default0, auto0, w0), (default1, auto1, w1) = seen
    assert default0 == default1 == 0
    assert not torch.equal(w0, w1), "the optimizer step changed no weight"
    assert auto0 == auto1, "FSDP2 now advances the unsharded weights' version counters"
