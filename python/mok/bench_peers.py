"""The systems ``python -m mok.bench`` measures, each a differentiable ``(x, top_experts,
router_weights) -> out`` over the same weights (one ``Problem``):

- ``mok``: ``mok.nn.MoE`` (autograd over ``torch.ops.mok``);
- ``mok C++``: the same layer called through ``mok._C`` (what PyTorch adds is the difference);
- ``mok fp8`` (``--fp8``): mok with ``precision="fp8_block"`` on the same weight tensors;
- ``hf mok`` / ``hf grouped_mm``: transformers' Qwen3-MoE experts module with
  ``experts_implementation="mok"`` / ``"grouped_mm"`` (what a transformers user runs today);
- ``torch grouped_mm``: the pipeline a user writes by hand (argsort permute, ``torch._grouped_mm``
  over each expert's rows, SwiGLU, weighted sum in fp32);
- ``sonicmoe``: SonicMoE's given-routing entry point, when ``sonicmoe`` is importable;
- ``torch fp8`` (``--fp8``, CUDA): the FP8 pipeline a torch user writes (bench_torch_fp8);
- ``mok KNOB`` (``--knobs``): mok with one of ``MoKConfig``'s switches flipped (or ``FIELD=N``, or
  several joined by ``+``: ``flipped_config``), on the same weight
  tensors (shared, not copied) and a workspace of its own: a config A/B in the same rounds.

Peers hold routed experts only: with a shared expert only mok runs. The peers share one pair of
weight tensors in transformers' layouts (``peer_weights``): a peer adds its step's gradients and
working memory, not a copy of the weights (22.5 GB at ``dsv3``). A system that cannot be built
here is left out with the reason (``Problem.skipped``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from . import _C
from .nn import MoE


@dataclass
class System:
    name: str
    forward: Callable[[Tensor, Tensor, Tensor], Tensor]  # differentiable in x and router_weights
    parameters: list[Tensor]
    native_step: Callable[[], None] | None = None  # a whole fwd+bwd without autograd (mok C++)
    native_forward: Callable[[], None] | None = None


@dataclass
class Problem:
    """One shape's tensors: the routing is K distinct uniformly random experts per token, the
    router weights a softmax over them, weights ~ N(0, 1/fan_in)."""

    shape_name: str
    T: int
    H: int
    I: int
    E: int
    K: int
    Is: int
    x: Tensor
    top_experts: Tensor  # [T, K] int64
    router_weights: Tensor  # [T, K] fp32
    d_out: Tensor
    module: MoE
    skipped: dict[str, str] = field(default_factory=dict)
    peer_weights_pair: tuple[Tensor, Tensor] | None = None  # made by peer_weights on first use

    @property
    def flop_forward(self) -> float:
        return 6.0 * self.T * self.K * self.H * self.I + 6.0 * self.T * self.H * self.Is


def make_problem(
    shape_name: str, device: torch.device, seed: int = 0, shared: int | None = None
) -> Problem:
    shape = _C.named_shape(shape_name)
    T, H, I, E, K = (
        shape.num_tokens,
        shape.hidden,
        shape.intermediate,
        shape.num_experts,
        shape.top_k,
    )
    Is = shape.shared_intermediate if shared is None else shared
    gen = torch.Generator(device=device).manual_seed(seed)
    module = MoE(E, H, I, shared_intermediate_size=Is, device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, device=device, generator=gen) / p.shape[-1] ** 0.5)
    x = torch.randn(T, H, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.rand(T, E, device=device, generator=gen)
    top_scores, top = scores.topk(K, dim=1)
    weights = torch.softmax(top_scores, dim=1)
    d_out = torch.randn(T, H, device=device, generator=gen).to(torch.bfloat16)
    name = shape_name if shared is None else f"{shape_name}+shared{Is}"
    return Problem(name, T, H, I, E, K, Is, x, top, weights, d_out, module)


def sorted_moe(x, top_experts, router_weights, num_experts, experts):
    """The torch pipelines' frame: rows sorted by expert (stable), ``experts(rows, offsets)``
    (offsets: each expert's end row), and the weighted sum over each token's K slots in fp32
    (deterministic: no atomics)."""
    T, K = top_experts.shape
    flat = top_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    y = experts(x[order // K], offsets)
    weighted = y.float() * router_weights.reshape(-1)[order, None]
    slots = torch.empty_like(weighted).index_copy(0, order, weighted)
    return slots.view(T, K, -1).sum(dim=1).to(x.dtype)


def torch_grouped_mm_moe(x, top_experts, router_weights, gate_up, down):
    """The torch pipeline: one grouped GEMM per projection and SwiGLU between them."""

    def experts(rows, offsets):
        gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)

    return sorted_moe(x, top_experts, router_weights, gate_up.shape[0], experts)


def _fused_gate_up(module: MoE) -> Tensor:
    return torch.cat((module.w_gate.detach(), module.w_up.detach()), dim=1)


def _module_weights(module: MoE) -> list[Tensor | None]:
    """The module's six weight tensors in the layer's argument order (the shared ones None
    without a shared expert)."""
    return [
        module.w_gate,
        module.w_up,
        module.w_down,
        module.w_shared_gate,
        module.w_shared_up,
        module.w_shared_down,
    ]


def _mok_systems(p: Problem) -> list[System]:
    module = p.module
    systems = [System("mok", module, list(module.parameters()))]
    module(p.x, p.top_experts, p.router_weights)  # builds the workspace's layer
    layer = next(iter(module.workspace._layers.values()))
    params = _module_weights(module)
    out = torch.empty_like(p.x)
    grads = [torch.empty_like(t) for t in (p.x, p.router_weights, *params[:3])]
    grads += [torch.empty_like(w) if w is not None else None for w in params[3:]]
    top32 = p.top_experts.to(torch.int32)

    def capsules(tensors):
        return [None if t is None else to_dlpack(t.detach()) for t in tensors]

    def native_forward():
        stream = torch.cuda.current_stream().cuda_stream
        return layer.forward(*capsules([p.x, top32, p.router_weights, *params, out]), stream)

    def native_step():
        stream = torch.cuda.current_stream().cuda_stream
        context = native_forward()
        layer.backward(
            *capsules([p.x, top32, p.router_weights, *params, p.d_out, *grads]), stream, context
        )

    systems.append(
        System("mok C++", module, [], native_step=native_step, native_forward=native_forward)
    )
    return systems


def config_switches() -> list[str]:
    """MoKConfig's on/off fields: what ``--knobs`` can flip."""
    from .functional import MoKConfig

    return [f.name for f in fields(MoKConfig) if f.type in (bool, "bool")]


def config_numbers() -> list[str]:
    """MoKConfig's integer fields: what ``--knobs`` can set as ``FIELD=N``."""
    from .functional import MoKConfig

    return [f.name for f in fields(MoKConfig) if f.type in (int, "int")]


def config_texts() -> list[str]:
    """MoKConfig's text fields: what ``--knobs`` can set as ``FIELD=VALUE``."""
    from .functional import MoKConfig

    return [f.name for f in fields(MoKConfig) if f.type in (str, "str")]


def flipped_config(config, knob: str):
    """`config` with `knob` applied: a MoKConfig switch flipped, ``FIELD=N`` setting an integer
    field, ``FIELD=VALUE`` a text one, or several of those joined by ``+``, in turn (e.g.
    ``gemm_four_stages+gemm_lockstep_k_blocks=16``, or
    ``precision=fp8_block+fp8_swiglu=pass``: mok in FP8 with another SwiGLU place)."""
    for part in knob.split("+"):
        name, _, value = part.partition("=")
        if value and name in config_texts():
            config = replace(config, **{name: value})
            continue
        if value:
            numbers = config_numbers()
            if name not in numbers or not value.lstrip("-").isdigit():
                raise ValueError(
                    f"argument `knob` has {part!r}; valid: FIELD=N with FIELD one of "
                    f"{', '.join(numbers)}, or FIELD=VALUE with FIELD one of "
                    f"{', '.join(config_texts())}"
                )
            config = replace(config, **{name: int(value)})
            continue
        switches = config_switches()
        if name not in switches:
            raise ValueError(
                f"argument `knob` has {part!r}; valid: {', '.join(switches)}, or FIELD=N"
            )
        config = replace(config, **{name: not getattr(config, name)})
    return config


def _mok_config_system(p: Problem, name: str, config) -> System:
    """mok under `config` over the problem module's own weight tensors (no copy: each system's
    gradients are dropped before the next one runs), through a workspace of its own. In FP8 its
    quantized weights are kept between calls (weights_version "auto": the benchmark never
    updates the weights), the micro-batches' case of gradient accumulation."""
    from ._workspace import Workspace
    from .functional import moe

    module = p.module
    workspace = Workspace(config.to_native())
    workspace.weights_version = "auto"

    def forward(x: Tensor, top_experts: Tensor, router_weights: Tensor) -> Tensor:
        return moe(
            x,
            top_experts,
            router_weights,
            *_module_weights(module),
            swiglu_limit=module.swiglu_limit,
            workspace=workspace,
            config=config,
        )

    return System(name, forward, list(module.parameters()))


def _mok_knob_system(p: Problem, knob: str) -> System:
    """mok with `knob` applied to its MoKConfig (flipped_config)."""
    return _mok_config_system(p, f"mok {knob}", flipped_config(p.module.config, knob))


def _mok_fp8_system(p: Problem) -> System:
    """mok in FP8 (``precision="fp8_block"``), its quantized weights kept between calls by its
    workspace; over the same weight tensors as mok (a copy held 11.3 GB more at `dsv3_e128`,
    where FP8 then did not fit beside the other systems on an 80 GB card: session 48)."""
    return _mok_config_system(p, "mok fp8", replace(p.module.config, precision="fp8_block"))


def peer_weights(p: Problem) -> tuple[Tensor, Tensor]:
    """The peers' one pair of weights, made from the problem's on first use: gate_up [E, 2I, H]
    (gate rows, then up rows) and down [E, H, I], transformers' layouts, which SonicMoE reads
    through permuted views. Every peer steps on these same parameters; each system's gradients
    are dropped before the next one runs, so they never accumulate across systems."""
    if p.peer_weights_pair is None:
        p.peer_weights_pair = (
            torch.nn.Parameter(_fused_gate_up(p.module)),
            torch.nn.Parameter(p.module.w_down.detach().clone()),
        )
    return p.peer_weights_pair


def _hf_system(p: Problem, implementation: str) -> System:
    """transformers' Qwen3-MoE experts module over `peer_weights` (built on the meta device, so
    that its own parameters are never allocated)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    if implementation == "mok":
        import mok.integrations.transformers  # noqa: F401  registers "mok"
    config = Qwen3MoeConfig(
        hidden_size=p.H, moe_intermediate_size=p.I, num_experts=p.E, num_experts_per_tok=p.K
    )
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj, experts.down_proj = peer_weights(p)
    return System(f"hf {implementation}", experts, list(experts.parameters()))


def _torch_system(p: Problem) -> System:
    """The torch pipeline over `peer_weights`."""
    gate_up, down = peer_weights(p)

    def forward(x, top, weights):
        return torch_grouped_mm_moe(x, top, weights, gate_up, down)

    return System("torch grouped_mm", forward, [gate_up, down])


def _torch_fp8_system(p: Problem) -> System:
    """The torch FP8 pipeline (bench_torch_fp8) over `peer_weights`."""
    from .bench_torch_fp8 import torch_fp8_moe

    if not hasattr(torch, "_scaled_grouped_mm"):
        raise ImportError("this torch has no torch._scaled_grouped_mm")
    gate_up, down = peer_weights(p)

    def forward(x, top, weights):
        return torch_fp8_moe(x, top, weights, gate_up, down)

    return System("torch fp8", forward, [gate_up, down])


def _sonic_system(p: Problem) -> System:
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    # SonicMoE's layouts: w1 (2I, H, E) over [gate; up] rows (concat layout), w2 (H, I, E): views
    # of the peers' pair.
    w13, w2 = peer_weights(p)
    token_of_pair = torch.arange(p.T, device=p.x.device, dtype=torch.int32).repeat_interleave(p.K)
    experts_of_pair = p.top_experts.reshape(-1).to(torch.int32)

    def forward(x, top, weights):
        out, _ = moe_general_routing_inputs(
            x,
            weights.reshape(-1),
            token_of_pair,
            experts_of_pair,
            w13.permute(1, 2, 0),
            None,
            w2.permute(1, 2, 0),
            None,
            p.E,
            torch.cuda.current_stream().cuda_stream,
            ActivationType.SWIGLU,
            False,
            True,
        )
        return out

    return System("sonicmoe", forward, [w13, w2])


SYSTEM_NAMES = (
    "mok",
    "mok C++",
    "mok fp8",
    "sonicmoe",
    "hf grouped_mm",
    "torch grouped_mm",
    "torch fp8",
    "hf mok",
)


def systems_of(
    p: Problem,
    peers: bool = True,
    fp8: bool = False,
    only: set[str] | None = None,
    knobs: list[str] | None = None,
) -> list[System]:
    """mok's systems (with ``fp8``, mok in FP8 too; with ``knobs``, mok with each of those
    MoKConfig switches flipped), and the peers that run here (the others go to ``p.skipped``
    with why). ``only``: the names (SYSTEM_NAMES) to build, "mok" always among them (every
    ratio is to it); the others are not built at all (their memory and warm-up spared), and
    ``p.skipped`` says so."""
    if only is not None:
        unknown = sorted(set(only) - set(SYSTEM_NAMES))
        if unknown:
            raise ValueError(f"argument `only` names {unknown}; valid: {', '.join(SYSTEM_NAMES)}")
        only = set(only) | {"mok"}

    def wanted(name: str) -> bool:
        if only is None or name in only:
            return True
        p.skipped[name] = "not among the systems asked for (--systems)"
        return False

    systems = (
        _mok_systems(p)
        if p.x.device.type == "cuda"
        else [System("mok", p.module, list(p.module.parameters()))]
    )
    systems = [s for s in systems if wanted(s.name)]
    if fp8 and wanted("mok fp8"):
        systems.append(_mok_fp8_system(p))
    systems += [_mok_knob_system(p, knob) for knob in knobs or []]
    if not peers or p.Is > 0:
        if p.Is > 0:
            p.skipped["peers"] = "a shared expert: the peers hold routed experts only"
        return systems
    # A peer steps on the peers' one weight pair (made by the first peer built) and, while it
    # steps, holds their gradients: one that would leave less than that much memory free is
    # left out (dsv3: 22.5 GB of weights).
    weight_bytes = sum(t.numel() * t.element_size() for t in p.module.parameters())

    builders = [
        ("sonicmoe", lambda: _sonic_system(p)),
        ("hf grouped_mm", lambda: _hf_system(p, "grouped_mm")),
        ("torch grouped_mm", lambda: _torch_system(p)),
        ("hf mok", lambda: _hf_system(p, "mok")),
    ]
    if fp8 and p.x.device.type == "cuda":  # FP8 tensor cores only
        builders.insert(3, ("torch fp8", lambda: _torch_fp8_system(p)))
    for name, build in builders:
        if not wanted(name):
            continue
        if p.x.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(p.x.device)
            copies = 1 if p.peer_weights_pair is not None else 2
            needed = copies * weight_bytes + (4 << 30)
            if free < needed:
                what = "their gradients" if copies == 1 else "the peers' weights, their gradients"
                p.skipped[name] = (
                    f"not enough GPU memory beside the others: {free / 2**30:.1f} GiB free, "
                    f"{needed / 2**30:.1f} GiB needed ({what} and the step's working memory); "
                    f"run it with fewer --systems"
                )
                continue
        try:
            systems.append(build())
        except ImportError as error:
            p.skipped[name] = f"not importable ({error})"
    return systems
