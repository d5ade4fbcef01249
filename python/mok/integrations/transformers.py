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

FP8 training (block-scaled e4m3, DeepSeek-V3's recipe) is a config away::

    mok.integrations.transformers.prepare(model, mok.MoKConfig(precision="fp8_block"))

The weights stay bf16 parameters, quantized by every call; with ``weights_version="auto"``
(plain torch.optim training: not under FSDP2 or DeepSpeed ZeRO-3, whose unsharding rewrites a
weight without advancing its version counter) the quantization is kept while ``gate_up_proj``
and ``down_proj`` are unchanged, so the micro-batches of one optimizer step quantize them once.
Hidden and intermediate sizes must then be multiples of 128.

A model loaded in FP8 (``quantization_config=FineGrainedFP8Config(...)``, or an FP8 checkpoint
such as Qwen3's or DeepSeek-V3's: e4m3 experts with one scale per 128 x 128 block) takes the
same ``experts_implementation="mok"``: its ``FP8Experts`` run mok's FP8 layer on the
checkpoint's own codes, read in place, as frozen weights (no gradient for the codes and scales;
x and the router weights get theirs, for fine-tuning around FP8 experts). Each backward then
transposes the codes for the input gradient; ``prepare(model, weights_version="auto")`` keeps
the transposed codes while the checkpoint's tensors are unchanged (safe unless something
rewrites them through ``.data``, as some RL weight-sync code does).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from .. import functional, ops
from .._workspace import Workspace

__all__ = ["mok_experts_forward", "mok_fp8_experts_forward", "prepare", "register"]

_SILU = ("silu", "swish")


def _reject(module, why: str):
    raise NotImplementedError(
        f'experts_implementation="mok" cannot run {type(module).__name__}: {why}. Use another '
        "experts_implementation for this model"
    )


def _check_gated_silu(module, act: str) -> None:
    """What both experts forms need: no biases, a gate, a SiLU activation (`act`)."""
    if getattr(module, "has_bias", False):
        _reject(module, "its experts have biases (mok's experts have none)")
    if not getattr(module, "has_gate", True):
        _reject(module, "its experts have no gate (mok's are SwiGLU)")
    if act not in _SILU:
        _reject(module, f"its activation is {act!r}; mok's experts are SwiGLU (silu)")


def _check_layout(module) -> None:
    from transformers.integrations.moe import _default_apply_gate

    _check_gated_silu(module, getattr(getattr(module, "config", None), "hidden_act", "silu"))
    if not getattr(module, "is_concatenated", True):
        _reject(module, "its gate and up rows are interleaved (mok takes gate rows, then up rows)")
    if getattr(module, "is_transposed", False):
        _reject(module, "its expert weights are stored transposed ([E, H, 2I])")
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        _reject(
            module,
            "it defines its own gated activation (gpt-oss: gate * sigmoid(1.702 gate) * (up + 1), clamped)",
        )


def _is_fp8_checkpoint(module) -> bool:
    """An experts module of a model loaded in FP8 (transformers' fine-grained FP8 quantization,
    ``FP8Experts``): e4m3 codes with a ``*_scale_inv`` beside each weight."""
    return hasattr(module, "gate_up_proj_scale_inv")


def _check_fp8_layout(module) -> None:
    # FP8Experts reads its activation as transformers' ACT2FN[hidden_activation or hidden_act].
    config = getattr(module, "config", None)
    act = next(
        (getattr(config, n) for n in ("hidden_activation", "hidden_act") if hasattr(config, n)),
        "silu",
    )
    _check_gated_silu(module, act)
    if module.gate_up_proj.dtype != torch.float8_e4m3fn:
        _reject(
            module,
            f"its expert weights are {module.gate_up_proj.dtype}; mok takes float8_e4m3fn codes",
        )
    block = tuple(getattr(module, "block_size", None) or ())
    if block != (128, 128):
        _reject(
            module,
            f"its weights are quantized in blocks of {list(block) or 'one tensor'}; mok's FP8 "
            "weights have one scale per 128 x 128 block",
        )
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        _reject(
            module,
            "its activations have static scales; mok quantizes them per 1 x 128 group as they come",
        )
    if getattr(module, "swiglu_alpha", None) is not None:
        _reject(module, "its activation is gpt-oss's (gate * sigmoid(alpha gate) * (up + 1))")


def _config_for(module, config: functional.MoKConfig | None) -> functional.MoKConfig:
    """`config` (or the default) for `module`; precision fp8_block for an FP8 checkpoint's."""
    config = config or functional.MoKConfig()
    return replace(config, precision="fp8_block") if _is_fp8_checkpoint(module) else config


def _workspace_of(module) -> Workspace | None:
    workspace = getattr(module, "_mok_workspace", None)
    if workspace is None and not torch.compiler.is_compiling():
        workspace = Workspace(_config_for(module, None).to_native())
        module._mok_workspace = workspace
    return workspace  # None while tracing an unprepared module: a shared default workspace


def prepare(
    model: torch.nn.Module,
    config: functional.MoKConfig | None = None,
    weights_version: int | str | None = None,
) -> torch.nn.Module:
    """Gives every experts module of `model` its own mok workspace now (no device memory yet).
    With `config`, the workspaces run under it, replacing any a module had: e.g.
    ``MoKConfig(precision="fp8_block")`` trains the experts in FP8 (block-scaled e4m3). The
    experts of a model loaded in FP8 always run with precision fp8_block. `weights_version`
    (``Workspace.weights_version``; None leaves it as it is, 0 for a new workspace): "auto"
    keeps the FP8 weights' quantization while the parameters are unchanged, where only in-place
    optimizer updates write them. Call it before training, not between a forward and its
    backward."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            (_check_fp8_layout if _is_fp8_checkpoint(module) else _check_layout)(module)
            if config is None:
                _workspace_of(module)
            else:
                module._mok_workspace = Workspace(_config_for(module, config).to_native())
            if weights_version is not None:
                module._mok_workspace.weights_version = weights_version
    return model


def _halves(
    gate_up: Tensor, intermediate: int, named_after: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gate and up halves of gate_up_proj as expert-strided views, named after it (or
    `named_after`, the parameter `gate_up` was detached from) in eager calls, so that an
    unchanged gate_up_proj names the same FP8 weights in every call; a traced graph's views are
    not named, and FP8 then quantizes them every call."""
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    if torch.compiler.is_compiling():
        return gate, up
    base = gate_up if named_after is None else named_after
    return ops.name_view(gate, base, "gate"), ops.name_view(up, base, "up")


class _FusedGateUpExperts(torch.autograd.Function):
    """mok's ops over a fused [E, 2I, H] gate/up weight: its halves as expert-strided views."""

    @staticmethod
    def forward(ctx, x, top_experts, router_weights, gate_up, down, handle, keep_context):
        gate, up = _halves(gate_up, down.shape[-1])
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
        gate, up = _halves(gate_up, down.shape[-1])
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


def _bf16_hidden_states(hidden_states: Tensor) -> Tensor:
    """hidden_states as mok's layer takes them: bf16, cast per call under bf16 autocast."""
    if functional._autocast_to_bf16(hidden_states.device.type):
        hidden_states = functional._bf16(hidden_states)
    if hidden_states.dtype != torch.bfloat16:
        raise ValueError(
            f"argument `hidden_states` has dtype {hidden_states.dtype}; mok's layer is bf16 "
            "(load the model with dtype=torch.bfloat16, or run it under "
            "torch.autocast(dtype=torch.bfloat16))"
        )
    return hidden_states


def _local_routes(top_k_index: Tensor, num_experts: int) -> Tensor:
    """Expert-parallel sentinels (ids past the experts) route nowhere, as mok's -1."""
    return torch.where(top_k_index < num_experts, top_k_index, -1)


def mok_experts_forward(
    self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The experts' forward through mok: ``sum_k top_k_weights[t, k] * expert(hidden_states[t])``."""
    _check_layout(self)
    gate_up, down = self.gate_up_proj, self.down_proj
    if functional._autocast_to_bf16(hidden_states.device.type):
        # An fp32 model under bf16 autocast (the Trainer's bf16=True): bf16 copies per call.
        gate_up, down = functional._bf16(gate_up), functional._bf16(down)
    hidden_states = _bf16_hidden_states(hidden_states)
    top_k_index = _local_routes(top_k_index, gate_up.shape[0])
    workspace = _workspace_of(self) or functional._default_workspace(functional._DEFAULT_CONFIG)
    handle = workspace.handle  # on CPU too: its config names the precision
    router_weights = top_k_weights.float()
    down = down.contiguous()
    # Nothing to differentiate (generation, evaluation): no forward context kept.
    keep_context = functional._records_graph(hidden_states, router_weights, gate_up, down)
    return _FusedGateUpExperts.apply(
        hidden_states, top_k_index, router_weights, gate_up, down, handle, keep_context
    )


def _fp8_scales(module, version: int | str) -> tuple[Tensor, Tensor, Tensor]:
    """The gate, up and down scales as mok takes them: fp32 and dense, [E, n/128, k/128] each:
    copies of the module's ``*_scale_inv`` (fp32 or UE8M0; kilobytes). Made every call with the
    workspace's weights_version 0 (the default: nothing assumed about what writes the
    checkpoint's tensors); otherwise kept on the module while the same number (or, for "auto",
    the same tensors and version counters) names them, so that the same scale tensors name the
    same weights in every call (ops.weight_id: the dgrads' transposed codes are then kept)."""
    sources = (module.gate_up_proj_scale_inv, module.down_proj_scale_inv)
    blocks = module.down_proj.shape[-1] // 128  # I / 128: the gate's block rows

    def converted() -> tuple[Tensor, Tensor, Tensor]:
        gate_up, down = (t.detach().float() for t in sources)
        return gate_up[:, :blocks].contiguous(), gate_up[:, blocks:].contiguous(), down.contiguous()

    if version == 0 or torch.compiler.is_compiling():
        return converted()
    key = (version, *((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in sources))
    cached = getattr(module, "_mok_fp8_scales", None)
    if cached is None or cached[0] != key:
        cached = module._mok_fp8_scales = (key, converted())
    return cached[1]


def mok_fp8_experts_forward(
    self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """An FP8 checkpoint's experts (``FP8Experts``) through mok's FP8 layer: the e4m3 codes read
    in place (the gate and up halves of ``gate_up_proj`` as expert-strided views), the scales
    as fp32 copies. The codes and scales get no gradient (frozen, as a fine-tune around FP8
    experts leaves them); hidden_states and top_k_weights do."""
    _check_fp8_layout(self)
    hidden_states = _bf16_hidden_states(hidden_states)
    top_k_index = _local_routes(top_k_index, self.gate_up_proj.shape[0])
    workspace = _workspace_of(self) or functional._default_workspace(_config_for(self, None))
    gate_scales, up_scales, down_scales = _fp8_scales(self, workspace.weights_version)
    gate_up, down = self.gate_up_proj, self.down_proj
    gate, up = _halves(gate_up.detach(), down.shape[-1], named_after=gate_up)
    down_codes = down.detach().contiguous()
    if not torch.compiler.is_compiling():
        ops.name_view(down_codes, down, "codes")
    return functional.moe(
        hidden_states,
        top_k_index,
        top_k_weights.float(),
        (gate, gate_scales),
        (up, up_scales),
        (down_codes, down_scales),
        swiglu_limit=getattr(self, "limit", None),
        workspace=workspace,
    )


def register() -> None:
    """Registers ``"mok"`` in transformers' experts interfaces (done on import): the bf16
    experts', and the fine-grained FP8 experts' where the installed transformers has one."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("mok", mok_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register("mok", mok_fp8_experts_forward)


register()
