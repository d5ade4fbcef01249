"""MoK's functional API over mok's ops, with the same names and argument order, and ``moe``.

Code written against MoK's ``mok.functional`` runs after changing only the import. Where mok is
more general than MoK, the docstrings say so:

- any expert-parallel size, 1 included (``group=None`` or a group of one is one GPU);
- no shared expert (pass None for its three weights) or one of any width Is;
- ``-1`` in ``top_experts`` routes a slot nowhere (its output term and gradient are zero);
- H, I and Is any multiple of 64; int32 or int64 ``top_experts``; any number of tokens;
- no capacity: ``schedule_capacity_multiplier`` is accepted and unused, since mok's schedule
  holds every routed row whatever the routing (no token is ever dropped);
- Hopper (sm_90a) GPUs, and every op also runs on CPU tensors through mok's CPU reference;
- with ``precision="fp8_block"``, any weight may be given pre-quantized, as MoK's
  ``(fp8, scale)`` tuple: ``float8_e4m3fn`` codes of the weight's shape and fp32 scales, one per
  128 x 128 block of each expert's matrix ([E_loc, n/128, k/128], or [n/128, k/128] for the
  shared expert), ``weight ~ codes * scale`` of its block: the layout mok's own quantization of a
  bf16 weight produces (``quantize_weight``). ``backward`` returns that weight's gradient in bf16.

The workspace holds the forward context (the schedule, the routed rows, g and u) that a backward
starts from, so a context names the latest forward of its workspace's layer; ``backward`` with a
context that a later call replaced recomputes those intermediates instead (same bits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from . import _C, ops
from ._workspace import Workspace

__all__ = [
    "MoKConfig",
    "MoKSchedule",
    "MoKForwardContext",
    "create_workspace",
    "get_workspace",
    "clear_workspace_cache",
    "build_schedule",
    "forward",
    "backward",
    "recompute_forward_context",
    "moe",
    "quantize_weight",
    "synchronize",
]


@dataclass(frozen=True, slots=True)
class MoKConfig:
    """Tuning knobs. None changes the result: outputs are bitwise identical for every valid
    config. MoK's fields, then mok's own.

    fwd_num_comm_sms, bwd_num_comm_sms: SMs for dispatch and combine (expert parallel).
    minibatch_size: rows per overlap step of the persistent kernels, a positive multiple of
        128 (MoK: of 256). 0 (the default): chosen from the shape and the GPU, the fewest rows
        that give each expert-grouped GEMM of a minibatch two full waves of tiles (MoK's rule).
    macrobatch_size: rows of the ring of routed intermediates, a multiple of 128 (and of an
        explicit minibatch_size); the backward recomputes all macrobatches but the first. 0 (the
        default): one macrobatch while the ring takes at most 8 GiB, else the largest multiple
        of the minibatch that fits.
    schedule_capacity_multiplier: accepted for MoK's code and unused (mok has no capacity).
    all_gather_top_experts_chunk_bytes: accepted for MoK's code and unused.
    persistent_forward, persistent_backward: run each direction's expert GEMMs as one persistent
        kernel (same bits).
    gemm_cta_pairs: run the expert GEMMs in clusters of two CTAs that multicast the weight tile
        they share (same bits).
    gemm_wide_tiles: run the forward's two GEMMs and the backward's two dgrads in 256 x 192
        tiles (same bits; bf16, without CTA pairs, the persistent kernels or the in-GEMM
        expert-parallel communication). Measured slower on H200 than the default 128 x 256
        tiles (docs/perf.md, session 18); off.
    gemm_tile_group: row tiles the expert GEMMs' walk takes together before the next group's
        (1-1024, default 8; same bits for any group).
    gemm_expert_aligned_groups: start each group of the row-tile GEMMs' walk where an expert
        starts (within 4 row tiles), so no expert's weight tiles are read by two groups a sweep
        apart (same bits; bf16 128 x 256 tiles without CTA pairs; off until measured faster).
    gemm_expert_groups: walk each expert's row tiles in the FP8 GEMMs as groups of their own,
        at most this many a group (0: groups of 8; same bits; precision "fp8_block" only; off
        until measured faster).
    fp8_row_tile_rows: the FP8 row-tile GEMMs' tile height, 128 or 192 (three consumer
        warpgroups; the weights read once per 192 rows; same bits; precision "fp8_block" only,
        not with gemm_expert_groups), or 0 (the default): chosen from the shape, 192 where the
        experts average at least 768 routed rows and the intermediate size is at least 2048.
    fp8_weight_grad_staging_tiles: the FP8 weight gradients' staging tiles, 1 or 2 (their
        epilogue alternates two, so that a tile waits for the store two tiles back; for
        weight-gradient tiles of few K-blocks; same bits; precision "fp8_block" only; 1: in the
        layer it measured level).
    fp8_swiglu: where FP8's SwiGLU and h's quantization run: "gate-up-without-context" (the
        default: in the gate/up GEMM's epilogue when no backward follows, e.g. under
        torch.no_grad, which then writes neither g nor u; a pass of its own otherwise), "pass"
        (always a pass of its own) or "gate-up" (always the epilogue); with gemm_expert_groups
        always the pass (same bits in every place; precision "fp8_block" only).
    fp8_gather_in_gate_up: in a forward without a context on one GPU, FP8's x rows gathered and
        quantized by the gate/up GEMM's spare producer warps instead of a pass before it (same
        bits; precision "fp8_block" only; off: measured slower, the GEMM then waits on the warps'
        gather).
    gemm_l2_placement: split the expert GEMMs' row tiles between the L2's two partitions, found
        by a probe when the workspace is made (same bits; bf16, without CTA pairs or the
        256 x 192 tiles; off until measured faster).
    gemm_four_stages: run the row-tile GEMMs (forward and dgrads) on a ring of four stages
        (their outputs stored in two rounds of 128 columns; same bits; bf16 kernel sequences,
        without CTA pairs or the expert-parallel push; off until measured faster).
    gemm_lockstep_k_blocks: keep the row-tile GEMMs' CTAs within about this many K-blocks of
        the slowest, so the CTAs sharing a weight tile read it from L2 together (same bits;
        without CTA pairs; 0 = off, else 2-4096; off until measured faster).
    gemm_auto_lockstep: where the local experts' weights exceed 1 GiB and they average under
        192 routed rows (``dsv3``), run the row-tile GEMMs on four stages in step within 16
        K-blocks unless ``gemm_four_stages`` or ``gemm_lockstep_k_blocks`` is set (same bits;
        bf16; on by default: 0.87x the forward's time at ``dsv3``).
    gemm_tiles_by_ticket: the row-tile GEMMs take their tiles from a ticket counter instead of
        a static walk, so CTAs of unequal speeds do not drift apart (same bits; bf16 128 x 256
        tiles, without CTA pairs, the L2 placement or the lockstep; off until measured faster).
    skip_padding_rows: stop the weight gradients at each expert's routed rows, and where the
        experts average at most 256 routed rows, run an expert's last row tile of the forward's
        GEMMs at 64 rows when it holds at most 64 (same bits; off computes every padding row).
    gemm_dgrad_half_row_tiles: run the backward's dgrads with the same 64-row last tiles as the
        forward (same bits; bf16 128 x 256 tiles without CTA pairs; off until measured faster).
    swiglu_backward_in_dgrad: run the SwiGLU backward in the epilogue of the backward's down
        dgrad instead of a pass of its own (same bits; bf16 kernel sequence, without
        ``persistent_backward``, the 256 x 192 tiles or ``ep_dispatch_in_gemm``; off until
        measured faster).
    weight_grad_pingpong: compute the weight gradients with the two consumer warpgroups of a
        CTA on different tiles (same bits; off by default until measured faster).
    overlap_kernel_launches: launch the layer's kernels with programmatic dependent launch, each
        scheduled while the previous one finishes and waiting for it before touching memory
        (same results; one GPU; off until measured faster).
    check_finite: scan every call's inputs for NaN and infinities; ``synchronize`` reports the
        first (a debugging aid: one memory-bound pass over the weights per call).
    local_dispatch: "producer-warps" (default) or "gather-kernel".
    ep_dispatch_in_gemm: expert parallel, the communication inside the GEMMs: the forward's
        gate/up GEMM pulls the routed rows from the other ranks, its down GEMM and the
        backward's gate/up dgrad push their rows back as the tiles are stored (same bits; bf16
        and the producer-warps dispatch only; off by default until measured faster).
    wait_timeout_s: device waits end with a diagnosis after this long.
    precision: "bf16", or "fp8_block" (e4m3 GEMM operands with 1 x 128 / 128 x 128 fp32 block
        scales; mok/fp8.h): the CPU reference, or mok's FP8 kernels on CUDA (one GPU, one
        macrobatch, hidden and intermediate sizes multiples of 128, and with a shared expert a
        token count that is a multiple of 128; other calls raise NotImplementedError saying
        which). Each call quantizes the weights, unless the workspace's ``weights_version``
        lets it keep them (``Workspace.weights_version``: a number the caller changes whenever
        the weights change, or "auto" where only in-place updates write them).
    """

    fwd_num_comm_sms: int = 40
    bwd_num_comm_sms: int = 28
    minibatch_size: int = 0
    macrobatch_size: int = 0
    schedule_capacity_multiplier: float = 0.5
    all_gather_top_experts_chunk_bytes: int = 2048
    persistent_forward: bool = False
    persistent_backward: bool = False
    gemm_cta_pairs: bool = False
    gemm_wide_tiles: bool = False
    gemm_tile_group: int = 8
    gemm_expert_aligned_groups: bool = False
    gemm_expert_groups: int = 0
    fp8_row_tile_rows: int = 0
    fp8_weight_grad_staging_tiles: int = 1
    fp8_swiglu: str = "gate-up-without-context"
    fp8_gather_in_gate_up: bool = False
    gemm_l2_placement: bool = False
    gemm_four_stages: bool = False
    gemm_lockstep_k_blocks: int = 0
    gemm_auto_lockstep: bool = True
    gemm_tiles_by_ticket: bool = False
    skip_padding_rows: bool = True
    gemm_dgrad_half_row_tiles: bool = False
    swiglu_backward_in_dgrad: bool = False
    weight_grad_pingpong: bool = False
    overlap_kernel_launches: bool = False
    check_finite: bool = False
    local_dispatch: str = "producer-warps"
    ep_dispatch_in_gemm: bool = False
    wait_timeout_s: float = 100.0
    precision: str = "bf16"

    def to_native(self) -> _C.MoeConfig:
        """The C++ layer's config (mok's checks name a bad field and what is valid)."""
        config = _C.MoeConfig()
        config.fwd_num_comm_sms = self.fwd_num_comm_sms
        config.bwd_num_comm_sms = self.bwd_num_comm_sms
        config.minibatch_size = self.minibatch_size
        config.macrobatch_size = self.macrobatch_size
        config.persistent_forward = self.persistent_forward
        config.persistent_backward = self.persistent_backward
        config.gemm_cta_pairs = self.gemm_cta_pairs
        config.gemm_wide_tiles = self.gemm_wide_tiles
        config.gemm_tile_group = self.gemm_tile_group
        config.gemm_expert_aligned_groups = self.gemm_expert_aligned_groups
        config.gemm_expert_groups = self.gemm_expert_groups
        config.fp8_row_tile_rows = self.fp8_row_tile_rows
        config.fp8_weight_grad_staging_tiles = self.fp8_weight_grad_staging_tiles
        config.fp8_swiglu = self.fp8_swiglu
        config.fp8_gather_in_gate_up = self.fp8_gather_in_gate_up
        config.gemm_l2_placement = self.gemm_l2_placement
        config.gemm_four_stages = self.gemm_four_stages
        config.gemm_lockstep_k_blocks = self.gemm_lockstep_k_blocks
        config.gemm_auto_lockstep = self.gemm_auto_lockstep
        config.gemm_tiles_by_ticket = self.gemm_tiles_by_ticket
        config.skip_padding_rows = self.skip_padding_rows
        config.gemm_dgrad_half_row_tiles = self.gemm_dgrad_half_row_tiles
        config.swiglu_backward_in_dgrad = self.swiglu_backward_in_dgrad
        config.weight_grad_pingpong = self.weight_grad_pingpong
        config.overlap_kernel_launches = self.overlap_kernel_launches
        config.check_finite = self.check_finite
        config.local_dispatch = self.local_dispatch
        config.ep_dispatch_in_gemm = self.ep_dispatch_in_gemm
        config.wait_timeout_s = self.wait_timeout_s
        config.precision = self.precision
        return config


@dataclass(frozen=True, slots=True)
class MoKSchedule:
    """The routing of one call. mok builds the schedule proper (each expert's rows, padded to
    128-row tiles) inside its forward and backward kernels; this holds what they take."""

    top_experts: Tensor  # [num_local_tokens, topk] int32 or int64; -1 marks no route
    num_local_experts: int

    @property
    def tokens_per_expert(self) -> Tensor:
        """[num_local_experts] int32: the routed rows of each expert of this rank (a GPU
        reduction over top_experts, computed when asked for)."""
        ids = self.top_experts.reshape(-1).to(torch.int64)
        counts = torch.bincount(ids[ids >= 0], minlength=self.num_local_experts)
        return counts[: self.num_local_experts].to(torch.int32)


@dataclass(frozen=True, slots=True)
class MoKForwardContext:
    """The forward's intermediates are kept in the workspace's layer; a backward given this
    context starts from them when that layer's latest forward ran on the same input tensors,
    unchanged since (else, and with ``use_context`` False, it recomputes them: same bits)."""

    use_context: bool = True


_WORKSPACE_CACHE: dict[tuple, Workspace] = {}
_DEFAULT_CONFIG = MoKConfig()
_DEFAULT_WORKSPACES: dict[MoKConfig, Workspace] = {
    _DEFAULT_CONFIG: Workspace(_DEFAULT_CONFIG.to_native())
}


def _default_workspace(config: MoKConfig) -> Workspace:
    workspace = _DEFAULT_WORKSPACES.get(config)
    if workspace is None:
        workspace = _DEFAULT_WORKSPACES[config] = Workspace(config.to_native())
    return workspace


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group=group)


def _resolve_device(device) -> torch.device:
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def create_workspace(
    config: MoKConfig,
    group=None,
    *,
    device: torch.device,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
) -> Workspace:
    """A new caller-owned workspace on `device` (CUDA; on CPU the ops run mok's CPU reference
    and the workspace holds nothing). `group`: None for one GPU without
    communication, or a ``torch.distributed`` process group (any size, 1 included), from which
    mok's NCCL communicator is bootstrapped (``mok.distributed``; collective over the group).
    The token, hidden and top-k sizes are checked against each call; the layers' memory is
    allocated by their first call."""
    if not isinstance(config, MoKConfig):
        raise ValueError(f"argument `config` is a {type(config).__name__}; expected a MoKConfig")
    for name, value in (
        ("num_local_tokens", num_local_tokens),
        ("hidden_size", hidden_size),
        ("topk", topk),
    ):
        if not isinstance(value, int) or value < (0 if name == "num_local_tokens" else 1):
            raise ValueError(f"argument `{name}` is {value!r}; expected a positive integer")
    device = _resolve_device(device)
    if device.type != "cuda" and group is not None:
        raise ValueError(f"argument `device` is {device}; expert parallelism runs on CUDA devices")
    native = config.to_native()
    expected = (num_local_tokens, hidden_size, topk)
    if group is None:
        return Workspace(native, expected=expected)
    from .distributed import expert_parallel_workspace

    with torch.cuda.device(device):
        return expert_parallel_workspace(native, group, expected=expected)


def get_workspace(
    config: MoKConfig,
    group=None,
    *,
    device: torch.device,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
) -> Workspace:
    """The cached workspace of these arguments, created on first use."""
    device = _resolve_device(device)
    group_key = None if group is None else getattr(group, "group_name", id(group))
    key = (config, group_key, device, num_local_tokens, hidden_size, topk)
    workspace = _WORKSPACE_CACHE.get(key)
    if workspace is None:
        workspace = create_workspace(
            config,
            group,
            device=device,
            num_local_tokens=num_local_tokens,
            hidden_size=hidden_size,
            topk=topk,
        )
        _WORKSPACE_CACHE[key] = workspace
    return workspace


def clear_workspace_cache() -> None:
    """Frees the cached workspaces once their devices are done with them."""
    for workspace in _WORKSPACE_CACHE.values():
        workspace.release()
    _WORKSPACE_CACHE.clear()


def synchronize(workspace: Workspace) -> None:
    """Waits for the current stream and raises what the device found (RuntimeError): bad expert
    ids naming the rank, token and slot, a timed-out wait with its diagnosis, non-finite inputs
    under ``check_finite``, CUDA errors. The ops never synchronize on their own."""
    workspace.synchronize()


def _check_workspace(workspace, x: Tensor, topk: int) -> None:
    if not isinstance(workspace, Workspace):
        raise ValueError(
            f"argument `workspace` is a {type(workspace).__name__}; expected a mok workspace"
        )
    expected = workspace.expected
    if expected is not None and x.dim() == 2:
        tokens, hidden, k = expected
        if (int(x.shape[0]), int(x.shape[1]), topk) != (tokens, hidden, k):
            raise ValueError(
                f"argument `x` has shape {list(x.shape)} with topk {topk}; the workspace was made "
                f"for num_local_tokens={tokens}, hidden_size={hidden}, topk={k}"
            )


def build_schedule(
    workspace: Workspace, config: MoKConfig, top_experts: Tensor, *, num_local_experts: int
) -> MoKSchedule:
    """The routing of one call: `top_experts` [num_local_tokens, topk] (int32 or int64, global
    expert ids, -1 = no route). Expert ids are checked on the device and reported by
    ``synchronize``; nothing is dropped whatever the routing."""
    if not isinstance(top_experts, Tensor) or top_experts.dim() != 2:
        raise ValueError("argument `top_experts` must be a [num_local_tokens, topk] tensor")
    if top_experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"argument `top_experts` has dtype {top_experts.dtype}; expected torch.int32 or torch.int64"
        )
    if not isinstance(num_local_experts, int) or num_local_experts < 1:
        raise ValueError(
            f"argument `num_local_experts` is {num_local_experts!r}; expected a positive integer"
        )
    return MoKSchedule(top_experts=top_experts, num_local_experts=num_local_experts)


def _limit(swiglu_limit: float | None) -> float:
    return math.inf if swiglu_limit is None else float(swiglu_limit)


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A bf16 weight [E, n, k] or [n, k] (n, k multiples of 128) as the ``(codes, scales)`` pair
    that FP8 workspaces take in its place: ``float8_e4m3fn`` codes of its shape and fp32 scales,
    one per 128 x 128 block. The bits the layer's own quantization of that weight gives (on CUDA
    on the current stream, without synchronizing; on CPU the reference's quantizer)."""
    n, k = weight.shape[-2:]
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(
        (*weight.shape[:-2], n // 128, k // 128), dtype=torch.float32, device=weight.device
    )
    if not weight.is_cuda:
        _C.quantize_weight_fp8(to_dlpack(weight.detach()), to_dlpack(codes), to_dlpack(scales))
        return codes, scales
    with torch.cuda.device(weight.device):
        stream = torch._C._cuda_getCurrentRawStream(weight.device.index)
        _C.quantize_weight_fp8(
            to_dlpack(weight.detach()), to_dlpack(codes), to_dlpack(scales), stream
        )
    return codes, scales


_WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down")


def _split_weights(weights) -> tuple[list, list]:
    """The six weights (gate, up, down, shared gate, shared up, shared down) as the ops take
    them: each tensor as it is, each ``(codes, scales)`` tuple as its codes, and the ops'
    ``weight_scales`` (empty when no weight is pre-quantized)."""
    tensors, scales = [], []
    for name, weight in zip(_WEIGHT_NAMES, weights):
        if isinstance(weight, (tuple, list)):
            if len(weight) != 2 or not all(isinstance(t, Tensor) for t in weight):
                raise ValueError(
                    f"argument `{name}` is a {type(weight).__name__} of {len(weight)} items; "
                    "a pre-quantized weight is a (codes, scales) pair of tensors"
                )
            codes, weight_scales = weight
            if codes.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"argument `{name}`: pre-quantized codes have dtype {codes.dtype}; "
                    "expected torch.float8_e4m3fn"
                )
            tensors.append(codes)
            scales.append(weight_scales)
        else:
            tensors.append(weight)
            scales.append(None)
    return tensors, (scales if any(t is not None for t in scales) else [])


def forward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: MoKSchedule,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    routed_down_weights: Tensor,
    swiglu_limit: float | None = None,
) -> tuple[Tensor, MoKForwardContext]:
    """The layer's forward: ``(out, context)``. x bf16 [T, H]; router_weights fp32 [T, K];
    shared weights bf16 [Is, H], [Is, H], [H, Is] or None; routed bf16 [E_loc, I, H],
    [E_loc, I, H], [E_loc, H, I]; any weight an ``(fp8, scale)`` pair in an FP8 workspace (the
    module docstring); swiglu_limit: gate = min(gate, L), up = clamp(up, -L, L)."""
    _check_workspace(workspace, x, int(schedule.top_experts.shape[1]))
    weights, weight_scales = _split_weights(
        (routed_gate_weights, routed_up_weights, routed_down_weights)
        + (shared_gate_weights, shared_up_weights, shared_down_weights)
    )
    out = ops.forward_eager(
        x,
        schedule.top_experts,
        router_weights,
        *weights,
        _limit(swiglu_limit),
        workspace.handle,
        weight_scales,
    )
    return out, MoKForwardContext(True)


def recompute_forward_context(
    config: MoKConfig,
    workspace: Workspace,
    schedule: MoKSchedule,
    x: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    swiglu_limit: float | None = None,
) -> MoKForwardContext:
    """A context for a backward that recomputes the forward's intermediates itself: mok fuses
    the recompute (schedule, gather, gate/up GEMM) into the backward's kernels, so nothing runs
    here and the backward given this context does it."""
    _check_workspace(workspace, x, int(schedule.top_experts.shape[1]))
    return MoKForwardContext(False)


def backward(
    config: MoKConfig,
    workspace: Workspace,
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: Tensor,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    routed_down_weights: Tensor,
    swiglu_limit: float | None = None,
    *,
    weight_grads: tuple[Tensor | None, ...] | None = None,
    accumulate_weight_grads: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The layer's backward, in MoK's order: ``(d_x, d_router_weights, d_routed_gate,
    d_routed_up, d_routed_down, d_shared_gate, d_shared_up, d_shared_down)`` (the shared ones None
    without a shared expert). ``d_router_weights`` is exact for any router weight, zero or
    negative included, and 0 for slots routed nowhere.

    mok's own: ``weight_grads`` gives the tensors the weight gradients go into, returned in their
    places: ``(d_routed_gate, d_routed_up, d_routed_down)`` and, with a shared expert, its three
    (bf16; with ``precision="fp8_block"`` also fp32, each its own, e.g. fp32 main gradients).
    ``accumulate_weight_grads`` (fp8_block) adds the gradients to what those tensors hold,
    ``d_w = round(d_w + gradient)`` with one fp32 add per element, instead of writing them: a
    micro-batch's gradients into main gradients kept across micro-batches (Megatron's
    ``main_grad``), in call order, so the same bits every run. Eager calls only."""
    if not isinstance(forward_context, MoKForwardContext):
        raise ValueError(
            f"argument `forward_context` is a {type(forward_context).__name__}; expected a MoKForwardContext"
        )
    _check_workspace(workspace, x, int(schedule.top_experts.shape[1]))
    weights, weight_scales = _split_weights(
        (routed_gate_weights, routed_up_weights, routed_down_weights)
        + (shared_gate_weights, shared_up_weights, shared_down_weights)
    )
    args = (
        grad_output.contiguous(),
        x,
        schedule.top_experts,
        router_weights,
        *weights,
        _limit(swiglu_limit),
        workspace.handle,
        forward_context.use_context,
        weight_scales,
    )
    if weight_grads is None:
        if accumulate_weight_grads:
            raise ValueError(
                "argument `accumulate_weight_grads` is True but `weight_grads` is None; pass "
                "the tensors to accumulate into"
            )
        grads = ops.backward_eager(*args)
    else:
        grads = _backward_into_weight_grads(args, weight_grads, accumulate_weight_grads)
    return (
        *grads[:5],
        *_shared_gradients(grads, (shared_gate_weights, shared_up_weights, shared_down_weights)),
    )


def _backward_into_weight_grads(args: tuple, weight_grads: tuple, accumulate: bool) -> list[Tensor]:
    """``backward``'s eight outputs with the weight gradients in the caller's tensors."""
    inputs = args[1:10]
    shared = inputs[6] is not None
    expected = 6 if shared else 3
    given = tuple(weight_grads)
    if len(given) not in (3, 6) or (
        len(given) == 6 and not shared and any(t is not None for t in given[3:])
    ):
        raise ValueError(
            f"argument `weight_grads` has {len(given)} tensors; expected {expected} (the routed "
            "gate, up, down" + (" and the shared expert's three)" if shared else ")")
        )
    if len(given) < expected or any(t is None for t in given[:expected]):
        raise ValueError(
            f"argument `weight_grads` lacks a tensor; expected {expected}, none of them None"
        )
    tensors = list(inputs) + [args[0], *given[:expected]]
    if not ops._plain_eager(tensors):
        raise ValueError(
            "argument `weight_grads`: mok writes into the given tensors in eager calls on plain "
            "tensors only (not under torch.compile tracing, a dispatch mode or tensor subclasses)"
        )
    grads = ops._gradients_like(inputs, weight_grads=False)
    empty = grads[2]
    grads[2 : 2 + expected] = given[:expected]
    grads[2 + expected :] = [empty] * (6 - expected)
    rest = args[10:]
    if args[1].is_cuda:
        return ops._backward_cuda_into(
            grads, args[0], inputs, *rest, accumulate_weight_grads=accumulate
        )
    return ops._backward_cpu_into(grads, *args, accumulate_weight_grads=accumulate)


def _shared_gradients(grads: list[Tensor], shared_weights: tuple) -> list[Tensor | None]:
    """The backward op's shared-expert gradients, None where there is no shared expert."""
    return [g if w is not None else None for g, w in zip(grads[5:], shared_weights)]


class _MoeFunction(torch.autograd.Function):
    """Autograd over the ops: the backward starts from the forward's context when its workspace
    still holds it, else recomputes."""

    @staticmethod
    def forward(ctx, *args):
        # args: the nine inputs of torch.ops.mok.forward, then swiglu_limit, the workspace, the
        # weight scales, keep_context (False when no backward will follow) and the weights' main
        # gradients (moe's accumulate_main_grads; None: the gradients are returned).
        inputs, (swiglu_limit, handle, weight_scales, keep, main_grads) = args[:9], args[9:]
        out = ops.forward_eager(*inputs, swiglu_limit, handle, weight_scales, keep)
        ctx.save_for_backward(*inputs, *weight_scales)
        ctx.swiglu_limit = swiglu_limit
        ctx.handle = handle
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, d_out):
        saved = ctx.saved_tensors
        inputs, weight_scales = saved[:9], list(saved[9:])
        # Frozen weights (none of the six needs a gradient: a fine-tune of the router, the
        # attention or adapters): the backward skips the weight-gradient GEMMs.
        wanted = any(ctx.needs_input_grad[3:9])
        if wanted and ctx.main_grads is not None:
            return _MoeFunction.backward_into_main_grads(ctx, d_out, inputs, weight_scales)
        grads = ops.backward_eager(
            d_out.contiguous(),
            *inputs,
            ctx.swiglu_limit,
            ctx.handle,
            True,
            weight_scales,
            wanted,
        )
        d_x, d_router_weights = grads[:2]
        # Pre-quantized weights (FP8 codes) take no gradient: the caller's master weights do.
        weight_grads = [
            g if wanted and w is not None and w.dtype != torch.float8_e4m3fn else None
            for g, w in zip(grads[2:], inputs[3:])
        ]
        return (d_x, None, d_router_weights, *weight_grads, None, None, None, None, None)

    @staticmethod
    def backward_into_main_grads(ctx, d_out, inputs, weight_scales):
        """The backward with each weight's gradient added to its main gradient (moe's
        accumulate_main_grads); weights without one (frozen) get a scratch tensor."""
        args = (d_out.contiguous(), *inputs, ctx.swiglu_limit, ctx.handle, True, weight_scales)
        shared = inputs[6] is not None
        targets = []
        for pair, w in zip(ctx.main_grads, inputs[3:]):
            target = pair[1] if pair is not None else None
            if target is None and w is not None:
                dtype = torch.bfloat16 if w.dtype == torch.float8_e4m3fn else w.dtype
                target = torch.zeros(w.shape, dtype=dtype, device=w.device)
            targets.append(target)
        grads = _backward_into_weight_grads(args, tuple(targets[: 6 if shared else 3]), True)
        for pair in ctx.main_grads:
            if pair is not None and hasattr(pair[0], "grad_added_to_main_grad"):
                pair[0].grad_added_to_main_grad = True
        return (grads[0], None, grads[1], *([None] * 6), None, None, None, None, None)


def _records_graph(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on `tensors`: grad mode on and any of them requiring a
    gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _autocast_to_bf16(device_type: str) -> bool:
    """Whether torch.autocast runs in bf16 on `device_type`. mok then takes fp32 inputs and
    weights as autocast's matmuls do: bf16 copies made per call (differentiable, so the gradients
    return in the leaves' own dtype), router weights in fp32; the output is bf16."""
    return (
        torch.is_autocast_enabled(device_type)
        and torch.get_autocast_dtype(device_type) == torch.bfloat16
    )


def _bf16(tensor: Tensor | None) -> Tensor | None:
    """`tensor` in bf16 if it is fp32 (autocast's cast); anything else as it is."""
    if tensor is None or tensor.dtype != torch.float32:
        return tensor
    return tensor.to(torch.bfloat16)


def moe(
    x: Tensor,
    top_experts: Tensor,
    router_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    w_shared_gate: Tensor | None = None,
    w_shared_up: Tensor | None = None,
    w_shared_down: Tensor | None = None,
    *,
    swiglu_limit: float | None = None,
    workspace: Workspace | None = None,
    config: MoKConfig | None = None,
    accumulate_main_grads: bool = False,
) -> Tensor:
    """The whole layer as one differentiable call: ``out[t] = sum_k w[t,k] expert_{e[t,k]}(x[t])
    + shared(x[t])`` with SwiGLU experts. Gradients flow to x, router_weights and every weight.
    x [T, H] bf16 (leading dimensions are flattened); top_experts [T, K] int32/int64;
    router_weights [T, K] fp32; weights as in ``forward`` (a pre-quantized ``(codes, scales)``
    weight gets no gradient: use ``backward`` for its bf16 gradient). `workspace` defaults to one shared
    workspace per config (the default config's is made at import, so ``torch.compile`` traces
    this call without a graph break): layers of one shape then share a layer, and a backward
    whose context another call replaced recomputes (``mok.nn.MoE`` holds its own). Under
    ``torch.autocast(dtype=torch.bfloat16)`` fp32 x and weights (fp32 master weights) are cast
    to bf16 per call, as autocast does for a matmul, and router weights to fp32. bf16 or fp16
    router weights (FSDP2's mixed precision casts forward inputs to bf16) are taken as their
    exact fp32 values.

    ``accumulate_main_grads`` (precision fp8_block, eager calls): Megatron-LM's gradient
    accumulation fusion. Every weight that takes a gradient has a ``main_grad`` attribute, an fp32
    (or bf16) tensor of its shape, and the backward adds the weight's gradient there
    (``backward``'s ``accumulate_weight_grads``) instead of returning it: its ``.grad`` is left
    alone, and its ``grad_added_to_main_grad`` is set True where it has one (Megatron's DDP reads
    it)."""
    leading = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    top2 = top_experts.reshape(-1, top_experts.shape[-1])
    rw2 = router_weights.reshape(-1, router_weights.shape[-1])
    if workspace is None:
        workspace = _default_workspace(config or _DEFAULT_CONFIG)
    handle = workspace.handle  # on CPU too: its config names the precision
    weights, weight_scales = _split_weights(
        (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    )
    main_grads = _main_grads(weights) if accumulate_main_grads else None
    autocast = _autocast_to_bf16(x.device.type)
    if autocast:
        x2 = _bf16(x2)
        weights = [_bf16(w) for w in weights]
    if autocast or rw2.dtype in (torch.bfloat16, torch.float16):
        # Exact in fp32 (a differentiable cast: the gradient returns in the caller's dtype):
        # FSDP2's MixedPrecisionPolicy casts every floating forward input to bf16.
        rw2 = rw2.float()
    # Nothing to differentiate (torch.no_grad, an evaluation): the forward skips what only a
    # backward reads (ForwardArgs::keep_context).
    keep = _records_graph(x2, rw2, *weights)
    out = _MoeFunction.apply(
        x2, top2, rw2, *weights, _limit(swiglu_limit), handle, weight_scales, keep, main_grads
    )
    return out.reshape(*leading, out.shape[-1])


_WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down")


def _main_grads(weights: list) -> list[tuple[Tensor, Tensor] | None] | None:
    """``moe``'s accumulate_main_grads: each weight with its ``main_grad`` (None where it takes
    no gradient), or None when no weight takes one. A weight that takes a gradient without one
    is refused by name."""
    main_grads = []
    for name, w in zip(_WEIGHT_NAMES, weights):
        if w is None or not w.requires_grad or w.dtype == torch.float8_e4m3fn:
            main_grads.append(None)
            continue
        main_grad = getattr(w, "main_grad", None)
        if not isinstance(main_grad, Tensor) or main_grad.shape != w.shape:
            found = (
                "none" if main_grad is None else f"shape {list(getattr(main_grad, 'shape', []))}"
            )
            raise ValueError(
                f"argument `{name}` takes a gradient but its `main_grad` is {found}; with "
                f"accumulate_main_grads every such weight needs one of its shape {list(w.shape)}"
            )
        main_grads.append((w, main_grad))
    return main_grads if any(g is not None for g in main_grads) else None
