"""Hugging Face transformers: ``experts_implementation="mok"``.

Importing this module registers ``"mok"`` in transformers' experts interface (the mechanism
behind its ``grouped_mm`` and ``sonicmoe`` implementations), so that::

    import mok.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mok")

runs every routed-experts module of Qwen3-MoE, Mixtral, the DeepSeek-V3 family and the other
models whose experts store ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``down_proj`` [E, H, I] with a SiLU gate, through mok (the router and any shared expert stay
transformers' own). Layouts mok cannot serve raise ``NotImplementedError`` saying why: gpt-oss
(interleaved gate/up, biases, its own clamped activation), transposed or biased experts, other
activations. The model must be bf16, or fp32 under ``torch.autocast(dtype=torch.bfloat16)``
(the experts then run on bf16 copies of their weights, made per call).

Each experts module gets its own mok workspace (made on its first eager call; ``prepare(model)``
makes them all up front, e.g. before ``torch.compile``), so its backward starts from its forward's
context. The gate and up halves of ``gate_up_proj`` reach mok's kernels as views (an expert
stride of 2I*H: no copy in the forward), and the backward's kernels write their gradients into
the two halves of one [E, 2I, H] tensor, the parameter's gradient (no concatenation: at 128
experts of DeepSeek-V3's size that copy took ~5 ms of a 20 ms step).
"""

from __future__ import annotations

import torch
from torch import Tensor

import math

from .. import functional, ops
from .._workspace import Workspace

__all__ = ["mok_experts_forward", "prepare", "register"]

_SILU = ("silu", "swish")


def _reject(module, why: str):
    raise NotImplementedError(
        f'experts_implementation="mok" cannot run {type(module).__name__}: {why}. Use another '
        "experts_implementation for this model"
    )


def _check_layout(module) -> None:
    from transformers.integrations.moe import _default_apply_gate

    if getattr(module, "has_bias", False):
        _reject(module, "its experts have biases (mok's experts have none)")
    if not getattr(module, "is_concatenated", True):
        _reject(module, "its gate and up rows are interleaved (mok takes gate rows, then up rows)")
    if getattr(module, "is_transposed", False):
        _reject(module, "its expert weights are stored transposed ([E, H, 2I])")
    if not getattr(module, "has_gate", True):
        _reject(module, "its experts have no gate (mok's are SwiGLU)")
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        _reject(
            module,
            "it defines its own gated activation (gpt-oss: gate * sigmoid(1.702 gate) * (up + 1), clamped)",
        )
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in _SILU:
        _reject(module, f"its activation is {act!r}; mok's experts are SwiGLU (silu)")


def _workspace_of(module) -> Workspace | None:
    workspace = getattr(module, "_mok_workspace", None)
    if workspace is None and not torch.compiler.is_compiling():
        workspace = Workspace(functional.MoKConfig().to_native())
        module._mok_workspace = workspace
    return workspace  # None while tracing an unprepared module: the shared default workspace


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Gives every experts module of `model` its own mok workspace now (no device memory yet)."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            _check_layout(module)
            _workspace_of(module)
    return model


class _FusedGateUpExperts(torch.autograd.Function):
    """mok's ops over a fused [E, 2I, H] gate/up weight: its halves as expert-strided views."""

    @staticmethod
    def forward(ctx, x, top_experts, router_weights, gate_up, down, handle, keep_context):
        intermediate = down.shape[-1]
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        out = ops.forward_eager(
            x,
            top_experts,
            router_weights,
            gate,
            up,
            down,
            None,
            None,
            None,
            math.inf,
            handle,
            [],
            keep_context,
        )
        ctx.save_for_backward(x, top_experts, router_weights, gate_up, down)
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, top_experts, router_weights, gate_up, down = ctx.saved_tensors
        intermediate = down.shape[-1]
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        args = (d_out.contiguous(), x, top_experts, router_weights, gate, up, down)
        args += (None, None, None, math.inf, ctx.handle, True, [])
        if not (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            # Frozen experts (a fine-tune of the router, the attention or adapters): no weight
            # gradients computed.
            grads = ops.backward_eager(*args, False)
            return grads[0], None, grads[1], None, None, None, None
        grads, d_gate_up = ops.backward_fused_gate_up_eager(*args)
        d_x, d_router_weights, _, _, d_down = grads[:5]
        return d_x, None, d_router_weights, d_gate_up, d_down, None, None


def mok_experts_forward(
    self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The experts' forward through mok: ``sum_k top_k_weights[t, k] * expert(hidden_states[t])``."""
    _check_layout(self)
    gate_up, down = self.gate_up_proj, self.down_proj
    if functional._autocast_to_bf16(hidden_states.device.type):
        # An fp32 model under bf16 autocast (the Trainer's bf16=True): bf16 copies per call.
        hidden_states, gate_up, down = (functional._bf16(t) for t in (hidden_states, gate_up, down))
    if hidden_states.dtype != torch.bfloat16:
        raise ValueError(
            f"argument `hidden_states` has dtype {hidden_states.dtype}; mok's layer is bf16 "
            "(load the model with dtype=torch.bfloat16, or run it under "
            "torch.autocast(dtype=torch.bfloat16))"
        )
    num_experts = gate_up.shape[0]
    # Expert-parallel sentinels (ids past the experts) route nowhere, as mok's -1.
    top_k_index = torch.where(top_k_index < num_experts, top_k_index, -1)
    workspace = _workspace_of(self) or functional._default_workspace(functional._DEFAULT_CONFIG)
    handle = workspace.handle  # on CPU too: its config names the precision
    router_weights = top_k_weights.float()
    down = down.contiguous()
    # Nothing to differentiate (generation, evaluation): no forward context kept.
    keep_context = functional._records_graph(hidden_states, router_weights, gate_up, down)
    return _FusedGateUpExperts.apply(
        hidden_states, top_k_index, router_weights, gate_up, down, handle, keep_context
    )


def register() -> None:
    """Registers ``"mok"`` in transformers' experts interface (done on import)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("mok", mok_experts_forward)


register()
