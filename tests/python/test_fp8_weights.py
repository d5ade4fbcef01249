"""Pre-quantized FP8 weights (MoK's ``(fp8, scale)`` pairs) in an FP8 workspace: the pairs that
``mok.functional.quantize_weight`` makes give the bits of the bf16 weights they came from,
through MoK's forward/backward, ``moe`` and the ops themselves, on CPU (the reference) and CUDA;
CPU and CUDA quantize alike; misuse is refused by name."""

from __future__ import annotations

import math

import pytest
import torch

import mok.functional as F
from conftest import DEVICES, cuda_reason, make_problem

FP8 = F.MoKConfig(precision="fp8_block")
# MoK's order: shared gate, up, down, then routed gate, up, down.
MOK_ORDER = ("w_shared_gate", "w_shared_up", "w_shared_down", "w_gate", "w_up", "w_down")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def workspace_for(p, device, config=FP8):
    T, H = p["x"].shape
    return F.get_workspace(
        config,
        None,
        device=torch.device(device),
        num_local_tokens=T,
        hidden_size=H,
        topk=p["top_experts"].shape[1],
    )


def run_mok(p, device, weights, use_context=True):
    """MoK's forward then backward with `weights` in MoK's order: out and the 8 gradients."""
    workspace = workspace_for(p, device)
    schedule = F.build_schedule(workspace, FP8, p["top_experts"], num_local_experts=4)
    out, context = F.forward(FP8, workspace, schedule, p["x"], p["router_weights"], *weights)
    if not use_context:
        context = F.recompute_forward_context(
            FP8, workspace, schedule, p["x"], weights[0], weights[1], weights[3], weights[4]
        )
    d_out = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    grads = F.backward(
        FP8, workspace, schedule, context, d_out.to(torch.bfloat16), p["x"],
        p["router_weights"], *weights,
    )  # fmt: skip
    return [out, *grads]


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_weight_layout(device):
    """Codes of the weight's shape, one power-of-two scale per 128 x 128 block, codes * scale
    within e4m3's rounding of the weight, each block's largest code in [224, 448]; [E, n, k]
    and [n, k]."""
    p = make_problem(device, H=256, I=128, Is=128)
    for name in ("w_gate", "w_down", "w_shared_down"):
        weight = p[name]
        codes, scales = F.quantize_weight(weight)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == weight.shape
        n, k = weight.shape[-2:]
        assert scales.dtype == torch.float32
        assert scales.shape == (*weight.shape[:-2], n // 128, k // 128)
        expanded = scales.repeat_interleave(128, -2).repeat_interleave(128, -1)
        restored = codes.float() * expanded
        error = (restored - weight.float()).norm() / weight.float().norm()
        assert error < 0.07, (name, float(error))
        blocks = codes.float().abs().unflatten(-1, (k // 128, 128)).unflatten(-3, (n // 128, 128))
        largest = blocks.amax(dim=(-3, -1))
        assert torch.all((largest >= 224) & (largest <= 448)), name
        assert torch.all(torch.frexp(scales).mantissa == 0.5), name


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
def test_quantize_weight_same_bits_on_cpu_and_cuda():
    p = make_problem("cpu", H=256, I=256, E=3, seed=4)
    for name in ("w_gate", "w_down"):
        codes, scales = F.quantize_weight(p[name])
        cuda_codes, cuda_scales = F.quantize_weight(p[name].cuda())
        assert torch.equal(codes.view(torch.uint8), cuda_codes.cpu().view(torch.uint8)), name
        assert torch.equal(scales, cuda_scales.cpu()), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given", [MOK_ORDER, ("w_down",), ("w_shared_gate", "w_shared_up")])
def test_pre_quantized_weights_give_the_same_bits(device, given):
    # FP8 with a shared expert runs whole 128-row tiles of tokens on the GPU: T = 128.
    p = make_problem(device, T=128, H=256, I=128, Is=128, seed=7)
    want = run_mok(p, device, [p[name] for name in MOK_ORDER])
    weights = [F.quantize_weight(p[name]) if name in given else p[name] for name in MOK_ORDER]
    for use_context in (True, False):
        got = run_mok(p, device, weights, use_context)
        for index, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype, index
            assert torch.equal(bits(a), bits(b)), (index, use_context)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_differentiates_through_pre_quantized_weights(device):
    """``moe`` with frozen FP8 experts: the output, d_x and d_router_weights of the bf16 weights;
    the pairs take no gradient (their codes are not differentiable)."""
    p = make_problem(device, H=256, I=128, seed=8)
    workspace = workspace_for(p, device)
    results = []
    for pre_quantized in (False, True):
        x = p["x"].detach().requires_grad_(True)
        router = p["router_weights"].detach().requires_grad_(True)
        weights = [p[n] for n in ("w_gate", "w_up", "w_down")]
        if pre_quantized:
            weights = [F.quantize_weight(w) for w in weights]
        out = F.moe(x, p["top_experts"], router, *weights, workspace=workspace)
        out.float().square().sum().backward()
        results.append([out, x.grad, router.grad])
    for a, b in zip(*results):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_take_pre_quantized_weights(device):
    """torch.library.opcheck with float8 codes in the weights' places and their scales. Its
    schema test is left out: it compares inputs by arithmetic that float8 lacks (test_ops.py runs
    it on the same schema with bf16 weights)."""
    p = make_problem(device, H=256, I=128, Is=128, T=128, seed=9)
    names = ("w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down")
    pairs = [F.quantize_weight(p[n]) for n in names]
    handle = workspace_for(p, device).handle
    base = (p["x"], p["top_experts"], p["router_weights"], *[c for c, _ in pairs], math.inf, handle)
    scales = [s for _, s in pairs]
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mok.forward.default, (*base, scales), test_utils=utils)
    out = torch.ops.mok.forward(*base, scales)
    d_out = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.mok.backward.default, (d_out, *base, True, scales), test_utils=utils
    )
    grads = torch.ops.mok.backward(d_out, *base, True, scales)
    assert all(g.dtype == torch.bfloat16 for i, g in enumerate(grads) if i != 1)


def test_misuse_is_refused_by_name():
    p = make_problem("cpu", H=256, I=128, seed=10)
    codes, scales = F.quantize_weight(p["w_gate"])
    with pytest.raises(ValueError, match="`w_gate`: pre-quantized codes have dtype"):
        F.moe(p["x"], p["top_experts"], p["router_weights"], (p["w_gate"], scales), p["w_up"],
              p["w_down"], workspace=workspace_for(p, "cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="pre-quantized FP8 weights"):
        F.moe(p["x"], p["top_experts"], p["router_weights"], (codes, scales), p["w_up"],
              p["w_down"], workspace=workspace_for(p, "cpu", F.MoKConfig()))  # fmt: skip
    with pytest.raises(ValueError, match="w_gate_fp8.scales` has shape"):
        F.moe(p["x"], p["top_experts"], p["router_weights"], (codes, scales[:, :1, :1]),
              p["w_up"], p["w_down"], workspace=workspace_for(p, "cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="multiples of 128"):
        F.quantize_weight(torch.zeros(64, 128, dtype=torch.bfloat16))


def test_workspace_weights_version_is_checked():
    from mok._workspace import Workspace

    space = Workspace(FP8.to_native())
    assert space.weights_version == 0
    for good in (0, 5, "auto"):
        space.weights_version = good
        assert space.weights_version == good
    for bad in (-1, 1.5, True, "always", None):
        with pytest.raises(ValueError, match="argument `weights_version`"):
            space.weights_version = bad


@pytest.mark.parametrize("device", DEVICES)
def test_weights_written_behind_their_version_counter_are_quantized_again(device):
    """FP8 weights rewritten in place without their version counter advancing (as FSDP2's
    unsharding and ``.data`` copies write them): with the default weights_version 0 every call
    quantizes, so the next call sees the new values. A caller's number keeps the quantization
    until the number changes (on CUDA; the CPU reference keeps none)."""
    import mok

    def module_of(state=None):
        torch.manual_seed(0)
        module = mok.nn.MoE(8, 128, 128, config=FP8, device=device)
        if state is not None:
            module.load_state_dict(state)
        return module

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16).to(device)
    top = torch.randint(0, 8, (64, 2), generator=gen).to(device)
    weights = torch.rand(64, 2, generator=gen).to(device)
    module = module_of()
    with torch.no_grad():
        first = module(x, top, weights)
        module.w_gate.data.mul_(0.5)  # through .data: the version counter does not move
        assert torch.equal(module(x, top, weights), module_of(module.state_dict())(x, top, weights))

        module.workspace.weights_version = 1
        halved = module(x, top, weights)
        module.w_gate.data.mul_(2.0)  # the first values again, under the same number
        same_number = module(x, top, weights)
        module.workspace.weights_version = 2
        assert torch.equal(module(x, top, weights), first)
    assert not torch.equal(halved, first)
    if torch.device(device).type == "cuda":
        assert torch.equal(same_number, halved), "a kept number should keep the quantization"
