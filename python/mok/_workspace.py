"""Workspaces: the device memory of mok's layers, held between calls.

A ``Workspace`` owns one C++ ``GpuLayer`` per layer shape it has run (the routed experts' and
the shared expert's sizes, the tokens per call): each holds the schedule, the routed rows and the
forward context that a backward starts from. The ops (``mok.ops``) name a workspace by an integer
handle, so that ``torch.library`` schemas, ``torch.compile`` graphs and CUDA graphs carry no
Python object. A layer's memory is allocated by its first call: run one step before capturing a
CUDA graph.
"""

from __future__ import annotations

import atexit
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
        raise ValueError(
            f"argument `{name}` is a {type(tensor).__name__}; expected a tensor {dims}"
        )
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


def fingerprint(*tensors) -> tuple:
    """What identifies a call's inputs while they live: storage, version and shape of each."""
    return tuple(
        None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.device.index)
        for t in tensors
    )


def _config_fields(config: _C.MoeConfig) -> dict:
    """Every field of a native config, by name (to rebuild it: it does not pickle)."""
    return {
        name: getattr(config, name)
        for name, attribute in vars(type(config)).items()
        if isinstance(attribute, property)
    }


def _fresh_workspace(
    config_fields: dict, num_ranks: int, expected: tuple[int, int, int] | None
) -> "Workspace":
    config = _C.MoeConfig()
    for name, value in config_fields.items():
        setattr(config, name, value)
    return Workspace(config, None, num_ranks, expected)


class Workspace:
    """The layers of this process's devices (and of one expert-parallel group, when
    ``communicator`` is given). Making one allocates nothing: each layer is built by its first
    call, on the device of its tensors."""

    def __reduce__(self):
        """Copied (``copy.deepcopy`` of a module: an EMA copy) and pickled (``torch.save`` of a
        module) as a fresh workspace with the same config and nothing built: its layers are
        device memory and the last forward's context, which belong to the module it serves. An
        expert-parallel workspace holds this process's communicator and is not copied."""
        if self.communicator is not None:
            raise TypeError(
                "an expert-parallel mok workspace (mok.nn.MoE(..., group=...)) cannot be copied "
                "or pickled: it holds this process's communicator; save the module's state_dict "
                "and load it into a module built with its group"
            )
        return (_fresh_workspace, (_config_fields(self.config), self.num_ranks, self.expected))

    def __init__(
        self,
        config: _C.MoeConfig,
        communicator: object | None = None,
        num_ranks: int = 1,
        expected: tuple[int, int, int] | None = None,
    ) -> None:
        # Every knob's range, on any device (the CPU reference would run with any; the GPU
        # layer checks the rest against each call's sizes).
        config.check_knobs(num_ranks)
        self.config = config
        # (num_local_tokens, hidden_size, topk) of MoK's create_workspace, checked per call.
        self.expected = expected
        self.communicator = communicator
        self.num_ranks = num_ranks
        self._layers: dict[tuple, object] = {}
        self._ep_layers: list[object] = []  # keep the ranks' layers alive
        self._contexts: dict[tuple, tuple] = {}  # layer -> (context, inputs' fingerprint)
        self._weights_version: int | str = 0
        with _LOCK:
            self.handle = next(_NEXT_HANDLE)
            _REGISTRY[self.handle] = self

    @property
    def weights_version(self) -> int | str:
        """Precision fp8_block: when the layers may keep the weights they quantized between calls
        (ForwardArgs::weights_version). 0 (the default): never, every call quantizes them, which
        is right whatever writes the weights. A positive int: the caller names the weights' values
        and changes the number whenever they change (e.g. the optimizer step); calls with the
        same number and the same weight tensors (pointers) reuse the quantization, as the
        micro-batches of gradient accumulation can. ``"auto"``: the number is derived from the
        weight tensors' identity and version counters, which torch.optim's in-place updates
        advance; not under FSDP2 or DeepSpeed ZeRO-3, whose unsharding writes new values into
        the same tensor and storage without advancing the counter, nor where weights are written
        through ``.data``: there it would reuse stale weights. Inside a captured CUDA graph
        every call quantizes (a replay must quantize the weights its step updated)."""
        return self._weights_version

    @weights_version.setter
    def weights_version(self, value: int | str) -> None:
        valid = value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
        )
        if not valid:
            raise ValueError(
                f"argument `weights_version` is {value!r}; expected 0 (quantize every call), a "
                'positive int naming the weights\' values, or "auto"'
            )
        self._weights_version = value

    def layer(self, key: LayerKey, device: torch.device) -> _C.GpuLayer:
        """The C++ layer of `key` on `device`, built (its memory allocated) on first use."""
        slot = (device.index, key)
        layer = self._layers.get(slot)
        if layer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"mok: a new layer shape ({key}) inside a CUDA-graph capture; its workspace "
                    "is allocated on first use, so run one step before capturing"
                )
            shape = key.shape(self.num_ranks)
            with torch.cuda.device(device):
                if self.communicator is None:
                    layer = _C.GpuLayer(shape, self.config)
                else:
                    ep_layer = _C.EpLayer(shape, self.config, self.communicator)
                    self._ep_layers.append(ep_layer)
                    layer = ep_layer.rank_layer()
            self._layers[slot] = layer
        return layer

    def record_forward(
        self, key: LayerKey, device: torch.device, context: int, inputs: tuple
    ) -> None:
        self._contexts[(device.index, key)] = (context, inputs)

    def context_for(self, key: LayerKey, device: torch.device, inputs: tuple) -> int:
        """The context a backward of `inputs` may start from: the latest forward's, if it ran on
        these very tensors (unchanged since) and its intermediates are still held; else 0."""
        slot = (device.index, key)
        context, forward_inputs = self._contexts.get(slot, (0, None))
        if (
            context == 0
            or forward_inputs != inputs
            or not self._layers[slot].holds_context(context)
        ):
            return 0
        return context

    def synchronize(self) -> None:
        """Waits for the current streams and raises what the device found in any of this
        workspace's layers: bad expert ids (naming rank, token and slot), a timed-out wait with
        its diagnosis, non-finite inputs (``check_finite``), or a CUDA error (``RuntimeError``)."""
        for (index, _), layer in self._layers.items():
            device = torch.device("cuda", index)
            with torch.cuda.device(device):
                layer.synchronize(torch.cuda.current_stream(device).cuda_stream)

    def workspace_bytes(self) -> int:
        return sum(layer.workspace_bytes() for layer in self._layers.values())

    def release(self) -> None:
        """Frees the device memory (after the devices finished with it)."""
        if self._layers:
            torch.cuda.synchronize()
        self._layers.clear()
        self._ep_layers.clear()
        self._contexts.clear()
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


@atexit.register
def _release_all() -> None:
    """Frees every layer while the CUDA runtime is still up (at interpreter exit)."""
    for workspace in list(_REGISTRY.values()):
        workspace._layers.clear()
        workspace._ep_layers.clear()
