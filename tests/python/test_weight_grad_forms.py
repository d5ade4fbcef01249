"""The weight gradients into the caller's tensors (``mok.functional.backward``'s ``weight_grads``
and ``accumulate_weight_grads``, precision fp8_block): written in fp32 they round to the bf16
gradients' bits; accumulated they are ``round(old + gradient)`` in each tensor's own dtype,
bit for bit, on CPU (the reference) and CUDA, with a shared expert; ``mok.nn.MoE``'s
``accumulate_main_grads`` (Megatron's main gradients); misuse is refused by name."""

from __future__ import annotations

import pytest
import torch

import mok
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
    # Without a shared expert: the routed three (a shared three of None accepted alongside).
    q = make_problem("cpu", T=128, H=256, I=128, seed=9)
    routed = tuple(torch.zeros_like(g, dtype=torch.float32) for g in run(q, "cpu")[2:5])
    with pytest.raises(ValueError, match="`weight_grads` has 6 tensors; expected 3"):
        run(q, "cpu", weight_grads=routed + fp32[3:])
    got = run(q, "cpu", weight_grads=routed + (None, None, None))
    assert got[2] is routed[0] and got[5] is None


def fp8_module(device, **kwargs):
    torch.manual_seed(3)
    return mok.nn.MoE(
        4, 256, 128, shared_intermediate_size=128, config=FP8, device=device, **kwargs
    )


@pytest.mark.parametrize("device", DEVICES)
def test_moe_accumulates_into_main_grads(device):
    """``mok.nn.MoE(accumulate_main_grads=True)`` (Megatron's gradient accumulation fusion):
    each step adds its weight gradients to the parameters' fp32 ``main_grad`` and leaves
    ``.grad`` alone; one step's main gradient rounds to the bf16 ``.grad`` of a plain module,
    two equal steps give exactly twice it; d_x and d_router_weights are the plain module's."""
    p = make_problem(device, T=128, H=256, I=128, Is=128, seed=12)
    plain, fused = fp8_module(device), fp8_module(device, accumulate_main_grads=True)
    for w in fused.parameters():
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
        w.grad_added_to_main_grad = False

    def step(module):
        x = p["x"].detach().requires_grad_(True)
        router = p["router_weights"].detach().requires_grad_(True)
        module(x, p["top_experts"], router).float().square().sum().backward()
        return x.grad, router.grad

    want = step(plain)
    got = step(fused)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    first = {}
    for (name, w), (_, w_plain) in zip(fused.named_parameters(), plain.named_parameters()):
        assert w.grad is None, name
        assert w.grad_added_to_main_grad, name
        assert torch.equal(bits(w.main_grad.to(torch.bfloat16)), bits(w_plain.grad)), name
        first[name] = w.main_grad.clone()
    step(fused)
    for name, w in fused.named_parameters():
        assert torch.equal(w.main_grad, 2 * first[name]), name


def test_moe_without_a_main_grad_is_refused_by_name():
    p = make_problem("cpu", T=128, H=256, I=128, Is=128, seed=12)
    module = fp8_module("cpu", accumulate_main_grads=True)
    for name, w in module.named_parameters():
        if name != "w_up":
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="argument `w_up` takes a gradient but its `main_grad`"):
        module(p["x"], p["top_experts"], p["router_weights"])
