"""mok: a deterministic mixture-of-experts layer for NVIDIA Hopper, forward and backward.

The package over mok's C++ layer (the extension ``mok._C``):

- ``mok.ops``: ``torch.library`` ops in the ``mok`` namespace (forward, backward), each with a
  CUDA implementation (mok's kernels), a CPU one (mok's CPU reference) and a fake one;
- ``mok.functional``: MoK's functional API (``MoKConfig``, ``get_workspace``,
  ``build_schedule``, ``forward``, ``backward``, ...) and ``moe``, one differentiable call;
- ``mok.nn.MoE``: an ``nn.Module`` holding the experts' weights, with autograd;
- ``mok.integrations.transformers``: ``experts_implementation="mok"`` for Hugging Face models.

Results are bitwise reproducible: the same inputs give the same bits on every run and for every
tuning knob of ``MoKConfig``.
"""

# PyTorch first: the extension then binds to the CUDA libraries (cuBLAS, NCCL) that PyTorch
# loaded, instead of loading a second copy of them (which corrupts the heap: seen on the H200).
import torch  # noqa: F401

from . import _C
from . import functional, nn, ops
from .functional import MoKConfig, moe

__all__ = ["MoKConfig", "functional", "moe", "nn", "ops", "_C"]
__version__ = "0.1.0"
