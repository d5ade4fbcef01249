"""``mok.nn.MoE``: the routed experts (and an optional shared expert) as an ``nn.Module``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import functional
from ._workspace import Workspace

__all__ = ["MoE"]


class MoE(nn.Module):
    """SwiGLU experts in mok's layouts, as ``nn.Parameter``s (visible to any optimizer, DDP and
    FSDP2): ``w_gate``, ``w_up`` [E_loc, I, H], ``w_down`` [E_loc, H, I], and with
    ``shared_intermediate_size`` > 0 ``w_shared_gate``, ``w_shared_up`` [Is, H],
    ``w_shared_down`` [H, Is]. The router stays the caller's: ``forward(x, top_experts,
    router_weights)`` takes its choices (int32/int64 global expert ids, -1 = no route) and
    weights (fp32), and returns ``sum_k router_weights[t, k] * expert(x[t]) + shared(x[t])``.

    Each module holds its own workspace (allocated by its first CUDA call), so its backward
    starts from its forward's context; bitwise reproducible; ``torch.compile(fullgraph=True)``
    traces it without a graph break, and a whole training step can be captured in a CUDA graph
    after one eager step. ``group``: a ``torch.distributed`` process group for expert
    parallelism (each rank holds num_experts / group size experts); None is one GPU.
    ``accumulate_main_grads`` (precision fp8_block; eager): each weight's gradient is added to
    its ``main_grad`` (fp32 main gradients kept across micro-batches, as Megatron-LM's DDP
    allocates them) instead of its ``.grad`` (``functional.moe``). In precision fp8_block every
    call quantizes the weights unless ``module.workspace.weights_version`` says they are
    unchanged: set it to the optimizer step (or "auto" when torch.optim alone writes them, not
    FSDP2 or ZeRO-3) so that the micro-batches of gradient accumulation quantize them once.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        shared_intermediate_size: int = 0,
        swiglu_limit: float | None = None,
        config: functional.MoKConfig | None = None,
        group=None,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
        accumulate_main_grads: bool = False,
    ) -> None:
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"argument `dtype` is {dtype}; mok's weights are torch.bfloat16")
        num_ranks = functional._group_size(group)
        if num_experts % num_ranks != 0:
            raise ValueError(
                f"argument `num_experts` is {num_experts}; expected a multiple of the group size {num_ranks}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // num_ranks
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.shared_intermediate_size = shared_intermediate_size
        self.swiglu_limit = swiglu_limit
        self.config = config or functional.MoKConfig()
        self.group = group
        self.accumulate_main_grads = accumulate_main_grads
        factory = {"device": device, "dtype": dtype}
        E, H, I, Is = (
            self.num_local_experts,
            hidden_size,
            intermediate_size,
            shared_intermediate_size,
        )
        self.w_gate = nn.Parameter(torch.empty(E, I, H, **factory))
        self.w_up = nn.Parameter(torch.empty(E, I, H, **factory))
        self.w_down = nn.Parameter(torch.empty(E, H, I, **factory))
        if Is > 0:
            self.w_shared_gate = nn.Parameter(torch.empty(Is, H, **factory))
            self.w_shared_up = nn.Parameter(torch.empty(Is, H, **factory))
            self.w_shared_down = nn.Parameter(torch.empty(H, Is, **factory))
        else:
            self.register_parameter("w_shared_gate", None)
            self.register_parameter("w_shared_up", None)
            self.register_parameter("w_shared_down", None)
        # Its own layers (built by the first call on each device): the handle is a plain integer
        # for the ops, so torch.compile and CUDA graphs see a constant.
        if group is not None:  # collective over the group (a group of one included)
            from .distributed import expert_parallel_workspace

            self._workspace = expert_parallel_workspace(self.config.to_native(), group)
        else:
            self._workspace = Workspace(self.config.to_native())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in), as nn.Linear's default."""
        for weight in self.parameters():
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    @property
    def workspace(self) -> Workspace:
        """This module's workspace (``workspace.synchronize()`` reports device faults)."""
        return self._workspace

    def forward(self, x: Tensor, top_experts: Tensor, router_weights: Tensor) -> Tensor:
        return functional.moe(
            x,
            top_experts,
            router_weights,
            self.w_gate,
            self.w_up,
            self.w_down,
            self.w_shared_gate,
            self.w_shared_up,
            self.w_shared_down,
            swiglu_limit=self.swiglu_limit,
            workspace=self._workspace,
            config=self.config,
            accumulate_main_grads=self.accumulate_main_grads,
        )

    @torch.no_grad()
    def load_hf_experts(self, gate_up_proj: Tensor, down_proj: Tensor) -> None:
        """Loads Hugging Face experts (Qwen3-MoE, Mixtral, DeepSeek-V3 layouts):
        ``gate_up_proj`` [E, 2I, H], gate rows then up rows, and ``down_proj`` [E, H, I]. The
        gate and up halves are copied into mok's two tensors; down is copied as is."""
        E, I, H = self.num_local_experts, self.intermediate_size, self.hidden_size
        if tuple(gate_up_proj.shape) != (E, 2 * I, H):
            raise ValueError(
                f"argument `gate_up_proj` has shape {list(gate_up_proj.shape)}; expected [E_loc={E}, 2I={2 * I}, H={H}]"
            )
        if tuple(down_proj.shape) != (E, H, I):
            raise ValueError(
                f"argument `down_proj` has shape {list(down_proj.shape)}; expected [E_loc={E}, H={H}, I={I}]"
            )
        self.w_gate.copy_(gate_up_proj[:, :I, :])
        self.w_up.copy_(gate_up_proj[:, I:, :])
        self.w_down.copy_(down_proj)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, "
            f"shared_intermediate_size={self.shared_intermediate_size}, swiglu_limit={self.swiglu_limit}"
        )
