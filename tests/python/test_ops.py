"""mok.ops: torch.library.opcheck on every op (schema, fake implementation, dispatch, and
``mutates_args``), with and without a shared expert, on CPU and on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

import mok.functional as F
from conftest import DEVICES, make_problem


def op_args(p, device):
    """torch.ops.mok.forward's arguments for problem `p` but its last, weight_scales (a backward
    takes d_out, these, use_context and weight_scales)."""
    handle = 0
    if device == "cuda":
        T, H = p["x"].shape
        handle = F.get_workspace(
            F.MoKConfig(),
            None,
            device=torch.device("cuda"),
            num_local_tokens=T,
            hidden_size=H,
            topk=p["top_experts"].shape[1],
        ).handle
    weights = (
        p["w_gate"],
        p["w_up"],
        p["w_down"],
        p["w_shared_gate"],
        p["w_shared_up"],
        p["w_shared_down"],
    )
    return (p["x"], p["top_experts"], p["router_weights"], *weights, math.inf, handle)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [0, 64])
def test_opcheck_forward_and_backward(device, shared):
    p = make_problem(device, Is=shared, T=40)
    args = op_args(p, device)
    weights = args[3:9]
    forward_args = (*args, [])
    torch.library.opcheck(torch.ops.mok.forward.default, forward_args)
    out = torch.ops.mok.forward(*forward_args)
    d_out = torch.randn_like(out)
    backward_args = (d_out, *args, True, [])
    torch.library.opcheck(torch.ops.mok.backward.default, backward_args)
    grads = torch.ops.mok.backward(*backward_args)
    assert [tuple(g.shape) for g in grads[:5]] == [
        tuple(p["x"].shape),
        tuple(p["router_weights"].shape),
        tuple(p["w_gate"].shape),
        tuple(p["w_up"].shape),
        tuple(p["w_down"].shape),
    ]
    for g, w in zip(grads[5:], weights[3:]):
        assert g.numel() == (w.numel() if w is not None else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_leave_their_inputs_untouched(device):
    p = make_problem(device, Is=64)
    before = {k: v.clone() for k, v in p.items() if isinstance(v, torch.Tensor)}
    args = op_args(p, device)
    out = torch.ops.mok.forward(*args, [])
    torch.ops.mok.backward(torch.ones_like(out), *args, True, [])
    for k, v in before.items():
        assert torch.equal(v, p[k]), k


def test_dispatch_free_only_for_plain_eager_cuda_tensors():
    """The eager shortcut past the dispatcher (ops.forward_eager) is taken only where the
    dispatcher would pick the CUDA implementation anyway."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mok import ops

    cpu = torch.zeros(2, 2)
    assert not ops._dispatch_free([cpu, None])
    with FakeTensorMode():
        fake = torch.zeros(2, 2)
    assert not ops._dispatch_free([fake])
    if torch.cuda.is_available():
        cuda = torch.zeros(2, 2, device="cuda")
        assert ops._dispatch_free([cuda, torch.nn.Parameter(cuda.clone()), None])
        with torch.overrides.TorchFunctionMode():
            assert not ops._dispatch_free([cuda])
        assert not ops._dispatch_free([cuda, cpu])


@pytest.mark.parametrize("device", DEVICES)
def test_eager_entries_match_the_ops(device):
    """ops.forward_eager / backward_eager (what mok.functional.moe and mok.nn.MoE call) give
    the ops' bits, with or without the dispatcher."""
    from mok import ops

    p = make_problem(device, Is=64, T=40)
    args = op_args(p, device)
    out = torch.ops.mok.forward(*args, [])
    eager = ops.forward_eager(*args, [])
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    d_out = torch.randn_like(out)
    backward_args = (d_out, *args, True, [])
    for a, b in zip(torch.ops.mok.backward(*backward_args), ops.backward_eager(*backward_args)):
        assert torch.equal(
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
            b.view(torch.int16) if b.dtype == torch.bfloat16 else b,
        )
