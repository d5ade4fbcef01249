"""mok's ``torch.library`` ops, in the ``mok`` namespace: few and coarse.

- ``mok::forward(x, top_experts, router_weights, w_gate, w_up, w_down, w_shared_gate,
  w_shared_up, w_shared_down, swiglu_limit, workspace, weight_scales) -> out``
- ``mok::backward(d_out, x, top_experts, router_weights, <the six weights>, swiglu_limit,
  workspace, use_context, weight_scales) -> (d_x, d_router_weights, d_w_gate, d_w_up, d_w_down,
  d_w_shared_gate, d_w_shared_up, d_w_shared_down)``

``weight_scales`` is empty, or six entries (gate, up, down, shared gate, shared up, shared down):
a weight given pre-quantized (an FP8 workspace only) is its ``float8_e4m3fn`` codes in the
weight's place, with its fp32 scales, one per 128 x 128 block ([E_loc, n/128, k/128]), at its
index; None for a bf16 weight. Gradients are bf16 either way.

Each has a CUDA implementation (mok's kernels, launched on PyTorch's current stream with outputs
from PyTorch's allocator and no host synchronization, so a training step can be captured in a
CUDA graph), a CPU implementation (mok's CPU reference: the same rounding points, so results
agree with the GPU to within bf16 accumulation order; slow, for tests and debugging) and a fake
one, and mutates nothing (``mutates_args=()``). The routing schedule is built inside each op (mok's
schedule kernels), and a backward whose context is no longer held recomputes the forward's
intermediates in its own kernels: there is no separate schedule or recompute op to call.

The forward context stays in the workspace's layer: with ``use_context`` the backward starts
from it when the latest forward of that layer ran on these very input tensors, unchanged since
(their storage, version and shape), and recomputes otherwise; the outputs are the same bits either
way. ``workspace`` is a handle from ``mok.functional`` or ``mok.nn.MoE`` (0 on CPU, where
nothing is kept). Without a shared expert its three weights are None and its gradients are empty.
Autograd is not registered on the ops: ``mok.functional.moe`` and ``mok.nn.MoE`` differentiate
through a ``torch.autograd.Function`` over them, which calls ``forward_eager`` / ``backward_eager``:
the ops, or in plain eager CUDA calls their CUDA implementations directly (the dispatcher's host
time is a tenth of a small layer's forward when a call is timed alone).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from . import _C
from ._workspace import fingerprint, layer_key, workspace_of

__all__ = ["forward", "backward"]


def _dl(tensor: Tensor | None):
    """A DLPack capsule of `tensor` (no copy, no stream synchronization), or None."""
    return None if tensor is None else to_dlpack(tensor)


def _capsules(*tensors):
    return [_dl(t) for t in tensors]


def _gradient_capsules(grads: list[Tensor], shared_weights: tuple) -> list:
    """The backward's eight outputs as capsules; the shared expert's are None without one, and
    every weight gradient's is None when they are empty (frozen weights: not computed)."""
    if grads[2].dim() != 3:  # _gradients_like's empty ones
        return [*_capsules(*grads[:2]), None, None, None, None, None, None]
    shared = [_dl(g) if w is not None else None for g, w in zip(grads[5:], shared_weights)]
    return [*_capsules(*grads[:5]), *shared]


def _cpu_precision(workspace: int) -> str:
    """The CPU reference's precision: the workspace's config's (bf16 without a workspace)."""
    return workspace_of(workspace).config.precision if workspace else "bf16"


_weight_ids = itertools.count(1)


def weight_id(w: Tensor):
    """The id `_weights_version` names a weight tensor by: one it carries (given on its first
    call). A view made anew each call (the halves of a fused gate/up weight) can be given a
    stable one with `name_view`."""
    found = getattr(w, "_mok_weight_id", None)
    if found is None:
        found = next(_weight_ids)
        w._mok_weight_id = found
    return found


def name_view(view: Tensor, base: Tensor, part: str) -> Tensor:
    """Names `view` (a view of `base`, which shares its version counter) by `base`'s id and
    `part`, so that views of an unchanged `base` made in different calls name the same weight:
    FP8 then keeps their quantization between calls instead of quantizing them every call."""
    view._mok_weight_id = (weight_id(base), part)
    return view


def _weights_version(space, weights) -> int:
    """ForwardArgs::weights_version of a call, by the workspace's ``weights_version``: 0
    (quantize every call) by default, in bf16 and while a CUDA graph is captured; the caller's
    number; or with "auto" a number that stays the same while the same weight tensors (each
    named by `weight_id`) keep their version counters."""
    mode = space.weights_version
    if space.config.precision != "fp8_block" or mode == 0:
        return 0
    if torch.cuda.is_current_stream_capturing():
        return 0
    if mode != "auto":
        return mode
    parts = [(weight_id(w), w._version) for w in weights if w is not None]
    return (hash(tuple(parts)) & 0x7FFFFFFFFFFFFFFF) | 1


def _weight_arguments(space, inputs: tuple, weight_scales: list) -> dict:
    """The layer call's keyword arguments about its weights: the FP8 weights_version, and the
    scales of pre-quantized weights."""
    version = _weights_version(space, (*inputs[3:], *weight_scales))
    extra = {"weights_version": version} if version else {}
    if weight_scales:
        extra["weight_scales"] = _capsules(*weight_scales)
    return extra


def _empty_gradient(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


def _layer_key(inputs: tuple, swiglu_limit: float, num_ranks: int = 1):
    """The layer a call's nine inputs (x, top_experts, router_weights, the six weights) need."""
    x, top_experts, _, w_gate, _, _, w_shared_gate, _, _ = inputs
    return layer_key(x, top_experts, w_gate, w_shared_gate, swiglu_limit, num_ranks)


def _gradients_like(
    inputs: tuple, d_gate_up: Tensor | None = None, weight_grads: bool = True
) -> list[Tensor]:
    """The backward's eight outputs for the nine inputs: d_x, d_router_weights, the routed
    weights' gradients, and the shared expert's (empty without one); bf16 for a weight given as
    FP8 codes. With `d_gate_up` ([E, 2I, H]) the gate and up gradients are its two halves, which
    the kernels write through their expert stride. Without `weight_grads` (frozen weights) the
    six weight gradients are empty and not computed."""
    x, _, router_weights, w_gate, w_up, w_down, *shared_weights = inputs

    def like(tensor):
        dtype = torch.bfloat16 if tensor.dtype == torch.float8_e4m3fn else tensor.dtype
        return torch.empty(tensor.shape, dtype=dtype, device=tensor.device)

    if not weight_grads:
        return [like(x), like(router_weights)] + [_empty_gradient(w_gate) for _ in range(6)]

    if d_gate_up is None:
        d_gate, d_up = like(w_gate), like(w_up)
    else:
        intermediate = w_gate.shape[1]
        d_gate, d_up = d_gate_up[:, :intermediate], d_gate_up[:, intermediate:]
    shared = [like(w) if w is not None else _empty_gradient(w_gate) for w in shared_weights]
    return [like(x), like(router_weights), d_gate, d_up, like(w_down), *shared]


# The CUDA implementations carry the ops' schemas (torch.library infers them from these
# signatures); the CPU and fake ones take the same arguments positionally: the nine inputs, then
# swiglu_limit and workspace (backward: d_out first, then use_context), weight_scales last.


def _run_on(device: torch.device):
    """The CUDA device context for a call on `device`: none when it is current already (the
    usual case; entering one costs microseconds in every call)."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _forward_cuda(
    x: Tensor,
    top_experts: Tensor,
    router_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    w_shared_gate: Tensor | None,
    w_shared_up: Tensor | None,
    w_shared_down: Tensor | None,
    swiglu_limit: float,
    workspace: int,
    weight_scales: list[Tensor | None],
    keep_context: bool = True,
) -> Tensor:
    inputs = (
        x,
        top_experts,
        router_weights,
        w_gate,
        w_up,
        w_down,
        w_shared_gate,
        w_shared_up,
        w_shared_down,
    )
    space = workspace_of(workspace)
    key = _layer_key(inputs, swiglu_limit, space.num_ranks)
    layer = space.layer(key, x.device)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    stream = torch._C._cuda_getCurrentRawStream(x.device.index)
    extra = _weight_arguments(space, inputs, weight_scales)
    with _run_on(x.device):
        context = layer.forward(
            *_capsules(*inputs), _dl(out), stream, keep_context=keep_context, **extra
        )
    space.record_forward(key, x.device, context, fingerprint(*inputs, *weight_scales))
    return out


forward = torch.library.custom_op("mok::forward", mutates_args=(), device_types="cuda")(
    _forward_cuda
)


@forward.register_kernel("cpu")
def _forward_cpu(*args):
    # keep_context (a 13th argument) changes nothing in the reference.
    inputs, (swiglu_limit, workspace, weight_scales) = args[:9], args[9:12]
    out = torch.empty_like(inputs[0], memory_format=torch.contiguous_format)
    _C.reference_forward(
        _layer_key(inputs, swiglu_limit).shape(1),
        *_capsules(*inputs),
        _dl(out),
        _cpu_precision(workspace),
        weight_scales=_capsules(*weight_scales),
    )
    return out


@forward.register_fake
def _forward_fake(*args):
    return torch.empty_like(args[0], memory_format=torch.contiguous_format)


def _backward_cuda(
    d_out: Tensor,
    x: Tensor,
    top_experts: Tensor,
    router_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    w_shared_gate: Tensor | None,
    w_shared_up: Tensor | None,
    w_shared_down: Tensor | None,
    swiglu_limit: float,
    workspace: int,
    use_context: bool,
    weight_scales: list[Tensor | None],
    weight_grads: bool = True,
) -> list[Tensor]:
    inputs = (
        x,
        top_experts,
        router_weights,
        w_gate,
        w_up,
        w_down,
        w_shared_gate,
        w_shared_up,
        w_shared_down,
    )
    return _backward_cuda_into(
        _gradients_like(inputs, weight_grads=weight_grads),
        d_out,
        inputs,
        swiglu_limit,
        workspace,
        use_context,
        weight_scales,
    )


def _backward_cuda_into(
    grads: list[Tensor],
    d_out: Tensor,
    inputs: tuple,
    swiglu_limit: float,
    workspace: int,
    use_context: bool,
    weight_scales: list[Tensor | None],
    accumulate_weight_grads: bool = False,
) -> list[Tensor]:
    """The CUDA backward into the eight outputs `grads` (the weight gradients added to what they
    hold with `accumulate_weight_grads`: fp8_block, BackwardArgs)."""
    x = inputs[0]
    space = workspace_of(workspace)
    key = _layer_key(inputs, swiglu_limit, space.num_ranks)
    layer = space.layer(key, x.device)
    context = (
        space.context_for(key, x.device, fingerprint(*inputs, *weight_scales)) if use_context else 0
    )
    stream = torch._C._cuda_getCurrentRawStream(x.device.index)
    extra = _weight_arguments(space, inputs, weight_scales)
    with _run_on(x.device):
        layer.backward(
            *_capsules(*inputs),
            _dl(d_out),
            *_gradient_capsules(grads, inputs[6:]),
            stream,
            context,
            accumulate_weight_grads=accumulate_weight_grads,
            **extra,
        )
    return grads


backward = torch.library.custom_op("mok::backward", mutates_args=(), device_types="cuda")(
    _backward_cuda
)


@backward.register_kernel("cpu")
def _backward_cpu(*args):
    return _backward_cpu_into(_gradients_like(args[1:10], weight_grads=_wants(args)), *args)


def _wants(args: tuple) -> bool:
    """The op's weight_grads argument (positional, after weight_scales; True when left out)."""
    return bool(args[14]) if len(args) > 14 else True


def _backward_cpu_into(
    grads: list[Tensor], *args, accumulate_weight_grads: bool = False
) -> list[Tensor]:
    """The CPU reference's backward into the eight outputs `grads` (accumulate_weight_grads as
    ``_backward_cuda_into``'s)."""
    d_out, inputs = args[0], args[1:10]
    swiglu_limit, workspace, _, weight_scales = args[10:14]
    _C.reference_backward(
        _layer_key(inputs, swiglu_limit).shape(1),
        *_capsules(*inputs),
        _dl(d_out),
        *_gradient_capsules(grads, inputs[6:]),
        _cpu_precision(workspace),
        weight_scales=_capsules(*weight_scales),
        accumulate_weight_grads=accumulate_weight_grads,
    )
    return grads


@backward.register_fake
def _backward_fake(*args):
    return _gradients_like(args[1:10], weight_grads=_wants(args))


_PLAIN = (Tensor, torch.nn.Parameter)


def _plain_eager(tensors) -> bool:
    """Eager (no torch.compile tracing), no torch function or dispatch mode active, and plain
    tensors only, all on one device type: a call the op's own implementation may take."""
    if (
        torch.compiler.is_compiling()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() != 0
    ):
        return False
    present = [t for t in tensors if t is not None]
    return all(type(t) in _PLAIN for t in present) and len({t.is_cuda for t in present}) == 1


def _dispatch_free(tensors) -> bool:
    """True when a call can go straight to the CUDA implementation: eager (no torch.compile
    tracing), no torch function or dispatch mode active (fake tensors, functionalization, debug
    modes), and plain CUDA tensors only (no subclass: DTensor, FakeTensor). The dispatcher would
    pick that implementation anyway; skipping it saves its per-call cost (tens of microseconds
    of host time, which a call timed alone sees in full)."""
    return _plain_eager(tensors) and all(t is None or t.is_cuda for t in tensors)


def forward_eager(*args) -> Tensor:
    """``torch.ops.mok.forward(*args)``, without the dispatcher when ``_dispatch_free``."""
    if _dispatch_free(args[:9]):
        return _forward_cuda(*args)
    return torch.ops.mok.forward(*args)


def backward_eager(*args) -> list[Tensor]:
    """``torch.ops.mok.backward(*args)``, without the dispatcher when ``_dispatch_free``."""
    if _dispatch_free(args[:10]):
        return _backward_cuda(*args)
    return torch.ops.mok.backward(*args)


def backward_fused_gate_up_eager(*args) -> tuple[list[Tensor], Tensor]:
    """``backward_eager`` for gate and up weights that are the two halves of one [E, 2I, H]
    tensor (Hugging Face's ``gate_up_proj``): also returns their gradient as one such tensor. In
    eager calls on plain tensors the kernels (or the CPU reference) write the two gradients
    straight into its halves, which the eight outputs then view. Otherwise (torch.compile
    tracing, a dispatch mode) the op runs as usual and the two are concatenated, a copy of the
    whole gradient: 15 GB of traffic, ~5 ms a step at `dsv3_e128`."""
    d_out, inputs, rest = args[0], args[1:10], args[10:]
    w_gate = inputs[3]
    if w_gate.dtype == torch.bfloat16 and _plain_eager(args[:10]):
        experts, intermediate, hidden = w_gate.shape
        d_gate_up = torch.empty(
            (experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=w_gate.device
        )
        grads = _gradients_like(inputs, d_gate_up)
        if w_gate.is_cuda:
            return _backward_cuda_into(grads, d_out, inputs, *rest), d_gate_up
        return _backward_cpu_into(grads, *args), d_gate_up
    grads = backward_eager(*args)
    return grads, torch.cat((grads[2], grads[3]), dim=1)
