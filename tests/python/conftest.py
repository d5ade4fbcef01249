"""Shared fixtures of mok's Python tests: the devices to run on (CPU always; CUDA where a Hopper
GPU is present, else those tests skip saying why), random problems, and an independent
pure-torch float64 implementation of the layer to check mok against."""

from __future__ import annotations

import math

import pytest
import torch


def cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device here (GPU tests run in scripts/gpu-check.sh)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"mok's kernels need sm_90a (Hopper); this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
    ),
]


def make_problem(
    device,
    T=48,
    H=128,
    I=128,
    E=4,
    K=2,
    Is=0,
    seed=0,
    routing="random",
    int64_ids=False,
    scale=0.05,
):
    """Random bf16 inputs and weights (on CPU, then moved), top_experts and router weights."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    x = (torch.randn(T, H, generator=gen)).to(torch.bfloat16)
    if routing == "one_expert":
        top = torch.zeros(T, K, dtype=torch.int64)
    elif routing == "duplicates":
        top = torch.randint(0, E, (T, 1), generator=gen).repeat(1, K)
    else:
        top = torch.randint(0, E, (T, K), generator=gen)
    if routing == "holes":
        top[torch.rand(T, K, generator=gen) < 0.3] = -1
    router = torch.rand(T, K, generator=gen)
    if routing == "signed":
        router = router * 2 - 1
        router[::5, 0] = 0.0
    problem = {
        "x": x,
        "top_experts": top.to(torch.int64 if int64_ids else torch.int32),
        "router_weights": router.float(),
        "w_gate": randn(E, I, H),
        "w_up": randn(E, I, H),
        "w_down": randn(E, H, I),
        "w_shared_gate": randn(Is, H) if Is else None,
        "w_shared_up": randn(Is, H) if Is else None,
        "w_shared_down": randn(H, Is) if Is else None,
    }
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in problem.items()}


def as_float64(p, requires_grad=False):
    """The problem's float tensors as float64 leaves (top_experts as is)."""
    result = {}
    for k, v in p.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().double().requires_grad_(requires_grad)
        result[k] = v
    return result


def torch_moe(p, swiglu_limit=None):
    """The layer's math with autograd, written independently of mok (a loop over experts and
    slots); give it float64 tensors (as_float64)."""
    x = p["x"]
    T, H = x.shape
    limit = math.inf if swiglu_limit is None else swiglu_limit

    def swiglu_expert(xs, wg, wu, wd):
        g = xs @ wg.T
        u = xs @ wu.T
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=-limit, max=limit)
        return (torch.nn.functional.silu(g) * u) @ wd.T

    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    top = p["top_experts"].long()
    for e in range(p["w_gate"].shape[0]):
        for k in range(top.shape[1]):
            rows = (top[:, k] == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            y = swiglu_expert(x[rows], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
            out = out.index_add(0, rows, p["router_weights"][rows, k : k + 1] * y)
    if p["w_shared_gate"] is not None:
        out = out + swiglu_expert(x, p["w_shared_gate"], p["w_shared_up"], p["w_shared_down"])
    return out


def relative_error(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_frozen_weights(module, x, top_experts, router_weights):
    """Freezing every weight of `module` (requires_grad off) leaves the gradients of x and the
    router weights bit for bit as they were, and the weights without gradients."""

    def input_gradients():
        leaf_x = x.clone().requires_grad_(True)
        leaf_w = router_weights.clone().requires_grad_(True)
        module(leaf_x, top_experts, leaf_w).float().pow(2).mean().backward()
        return leaf_x.grad, leaf_w.grad

    want = input_gradients()
    for p in module.parameters():
        p.grad = None
        p.requires_grad_(False)
    got = input_gradients()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(p.grad is None for p in module.parameters())
