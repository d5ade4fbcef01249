"""The weight gradients into the caller's tensors (``mok.functional.backward``'s ``weight_grads``
and ``accumulate_weight_grads``, precision fp8_block): written in fp32 they round to the bf16
gradients' bits; accumulated they are ``round(old + gradient)`` in each tensor's own dtype,
bit for bit, on CPU (the reference) and CUDA, with a shared expert; misuse is refused by name."""

from __future__ import annotations

import pytest
import torch

import mok.functional as F
from conftest import DEVICES, make_problem

FP8 = F.MoKConfig(precision="fp8_block")
# MoK's order: shared gate, up, down, then routed gate, up, down.
MOK_ORDER = ("w_shared_gate", "w_shared_up", "w_shared_down", "w_gate", "w_up", "w_down")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def run(p, device, config=FP8, **backward_kwargs):
    """MoK's forward then backward: the 8 gradients."""
    T, H = p["x"].shape
    workspace = F.get_workspace(
        config, None, device=torch.device(device), num_local_tokens=T, hidden_size=H, topk=2
    )
    schedule = F.build_schedule(workspace, config, p["top_experts"], num_local_experts=4)
    weights = [p[name] for name in MOK_ORDER]
    out, context = F.forward(config, workspace, schedule, p["x"], p["router_weights"], *weights)
    d_out = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    return F.backward(
        config, workspace, schedule, context, d_out.to(torch.bfloat16), p["x"],
        p["router_weights"], *weights, **backward_kwargs,
    )  # fmt: skip


def old_values(like: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(like.shape, generator=gen) * like.float().abs().mean().cpu()
    values[torch.rand(like.shape, generator=gen) < 0.05] = 0.0
    return values.to(dtype).to(like.device)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_and_accumulated_weight_gradients(device):
    # FP8 with a shared expert runs whole 128-row tiles of tokens on the GPU: T = 128.
    p = make_problem(device, T=128, H=256, I=128, Is=128, seed=9, routing="holes")
    want = run(p, device)
    # Routed gate, up, down, then the shared expert's: the order `weight_grads` takes.
    fp32 = [torch.full_like(g, float("nan"), dtype=torch.float32) for g in want[2:8]]
    got = run(p, device, weight_grads=tuple(fp32))
    for index, (given, returned, bf16) in enumerate(zip(fp32, got[2:8], want[2:8])):
        assert returned is given, index
        assert torch.equal(bits(given.to(torch.bfloat16)), bits(bf16)), index
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b)

    dtypes = [torch.float32, torch.bfloat16] * 3
    old = [old_values(g, dtype, 20 + i) for i, (g, dtype) in enumerate(zip(want[2:8], dtypes))]
    into = [o.clone() for o in old]
    got = run(p, device, weight_grads=tuple(into), accumulate_weight_grads=True)
    for index, (o, result, sums) in enumerate(zip(old, into, fp32)):
        expected = (o.float() + sums).to(o.dtype)
        assert torch.equal(bits(result), bits(expected)), index
    assert torch.equal(got[0], want[0])


def test_weight_grad_forms_are_refused_where_they_do_not_apply():
    p = make_problem("cpu", T=128, H=256, I=128, Is=128, seed=9)
    want = run(p, "cpu")
    fp32 = tuple(torch.zeros_like(g, dtype=torch.float32) for g in want[2:8])
    with pytest.raises(ValueError, match="d_w_gate is fp32; the bf16 layer"):
        run(p, "cpu", config=F.MoKConfig(), weight_grads=fp32)
    bf16 = tuple(torch.zeros_like(g) for g in want[2:8])
    with pytest.raises(ValueError, match="accumulate_weight_grads is set; the bf16 layer"):
        run(p, "cpu", config=F.MoKConfig(), weight_grads=bf16, accumulate_weight_grads=True)
    with pytest.raises(ValueError, match="`accumulate_weight_grads` is True but `weight_grads`"):
        run(p, "cpu", accumulate_weight_grads=True)
    with pytest.raises(ValueError, match="`weight_grads` has 2 tensors; expected 6"):
        run(p, "cpu", weight_grads=fp32[:2])
    with pytest.raises(ValueError, match="`weight_grads` lacks a tensor"):
        run(p, "cpu", weight_grads=fp32[:3])
    with pytest.raises(ValueError, match="`d_w_down` has dtype"):
        run(p, "cpu", weight_grads=fp32[:2] + (fp32[2].to(torch.float16),) + fp32[3:])
