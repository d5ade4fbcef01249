"""Workspaces: the device memory of mok's layers, held between calls.

A ``Workspace`` owns one C++ ``GpuLayer`` per layer shape it has run (the routed experts' and
the shared expert's sizes, the tokens per call): each holds the schedule, the routed rows and the
forward context that a backward starts from. The ops (``mok.ops``) name a workspace by an integer
handle, so that ``torch.library`` schemas, ``torch.compile`` graphs and CUDA graphs carry no
Python object. A layer's memory is allocated by its first call: run one step before capturing a
CUDA graph.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import torch

from . import _C

_REGISTRY: dict[int, "Workspace"] = {}
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class LayerKey:
    """What a C++ layer is built for: the shape of one call on one rank."""

    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int  # in the whole expert-parallel group
    top_k: int
    shared_intermediate: int
    swiglu_limit: float

    def shape(self, num_ranks: int) -> _C.MoeShape:
        shape = _C.MoeShape()
        shape.num_tokens = self.num_tokens
        shape.hidden = self.hidden
        shape.intermediate = self.intermediate
        shape.num_experts = self.num_experts
        shape.top_k = self.top_k
        shape.num_ranks = num_ranks
        shape.shared_intermediate = self.shared_intermediate
        shape.swiglu_limit = self.swiglu_limit
        return shape


def _expect_ndim(name: str, tensor: torch.Tensor, ndim: int, dims: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"argument `{name}` is a {type(tensor).__name__}; expected a tensor {dims}")
    if tensor.dim() != ndim:
        raise ValueError(
            f"argument `{name}` has shape {list(tensor.shape)}; expected {ndim} dimensions {dims}"
        )


def layer_key(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    w_gate: torch.Tensor,
    w_shared_gate: torch.Tensor | None,
    swiglu_limit: float,
    num_ranks: int = 1,
) -> LayerKey:
    """The layer shape of a call, from its tensors (mok's checks then validate every tensor)."""
    _expect_ndim("x", x, 2, "[T, H]")
    _expect_ndim("top_experts", top_experts, 2, "[T, K]")
    _expect_ndim("w_gate", w_gate, 3, "[E_loc, I, H]")
    if w_shared_gate is not None:
        _expect_ndim("w_shared_gate", w_shared_gate, 2, "[Is, H]")
    if math.isnan(swiglu_limit) or swiglu_limit <= 0:
        raise ValueError(
            f"argument `swiglu_limit` is {swiglu_limit}; expected a positive limit, or None (inf)"
        )
    return LayerKey(
        num_tokens=int(x.shape[0]),
        hidden=int(x.shape[1]),
        intermediate=int(w_gate.shape[1]),
        num_experts=int(w_gate.shape[0]) * num_ranks,
        top_k=int(top_experts.shape[1]),
        shared_intermediate=int(w_shared_gate.shape[0]) if w_shared_gate is not None else 0,
        swiglu_limit=float(swiglu_limit),
    )


class Workspace:
    """The layers of one device (and one expert-parallel group, when ``communicator`` is given)."""

    def __init__(
        self,
        config: _C.MoeConfig,
        device: torch.device,
        communicator: object | None = None,
        num_ranks: int = 1,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"argument `device` is {device}; a workspace lives on a CUDA device")
        self.config = config
        self.device = torch.device("cuda", device.index if device.index is not None else 0)
        self.communicator = communicator
        self.num_ranks = num_ranks
        self._layers: dict[LayerKey, object] = {}
        with _LOCK:
            self.handle = next(_NEXT_HANDLE)
            _REGISTRY[self.handle] = self

    def layer(self, key: LayerKey) -> _C.GpuLayer:
        """The C++ layer of `key`, built (and its memory allocated) on first use."""
        layer = self._layers.get(key)
        if layer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"mok: a new layer shape ({key}) inside a CUDA-graph capture; its workspace "
                    "is allocated on first use, so run one step before capturing"
                )
            shape = key.shape(self.num_ranks)
            with torch.cuda.device(self.device):
                if self.communicator is None:
                    layer = _C.GpuLayer(shape, self.config)
                else:
                    ep_layer = _C.EpLayer(shape, self.config, self.communicator)
                    layer = ep_layer.rank_layer()
                    self._layers[("ep", key)] = ep_layer  # keeps the rank's layer alive
            self._layers[key] = layer
        return layer

    def synchronize(self) -> None:
        """Waits for the current stream and raises what the device found in any of this
        workspace's layers: bad expert ids (naming rank, token and slot), a timed-out wait with
        its diagnosis, non-finite inputs (``check_finite``), or a CUDA error (``RuntimeError``)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.device):
            for key, layer in self._layers.items():
                if not isinstance(key, tuple):
                    layer.synchronize(stream)

    def workspace_bytes(self) -> int:
        return sum(
            layer.workspace_bytes() for key, layer in self._layers.items() if not isinstance(key, tuple)
        )

    def release(self) -> None:
        """Frees the device memory (after the device finished with it)."""
        torch.cuda.synchronize(self.device)
        self._layers.clear()
        with _LOCK:
            _REGISTRY.pop(self.handle, None)


def workspace_of(handle: int) -> Workspace:
    workspace = _REGISTRY.get(handle)
    if workspace is None:
        raise ValueError(
            f"argument `workspace` is {handle}, which names no live workspace; make one with "
            "mok.functional.get_workspace or create_workspace"
        )
    return workspace
