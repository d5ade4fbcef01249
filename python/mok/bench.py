"""``python -m mok.bench``: mok through PyTorch against mok's C++ layer, on one GPU.

At a named shape (``mok shapes`` lists them) with uniformly random routing, times in one process
on the same tensors, per call (median over calls, each synchronized) and sustained (calls queued
back to back, one synchronization at the end, as a training loop runs):

- ``torch.ops.mok`` through ``mok.nn.MoE`` (autograd, the ops' dispatch, DLPack): forward, and
  forward + backward;
- the C++ layer called directly through ``mok._C`` (the same kernels; what PyTorch adds is the
  difference).

Prints a table and, with ``--json PATH``, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.utils.dlpack import to_dlpack

from . import _C
from .nn import MoE


def _time(fn, calls: int, sustained: bool) -> float:
    """Milliseconds per call."""
    torch.cuda.synchronize()
    if sustained:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(shape_name: str, calls: int, seed: int) -> dict:
    shape = _C.named_shape(shape_name)
    T, H, I, E, K, Is = (shape.num_tokens, shape.hidden, shape.intermediate, shape.num_experts,
                         shape.top_k, shape.shared_intermediate)
    torch.manual_seed(seed)
    device = torch.device("cuda")
    module = MoE(E, H, I, shared_intermediate_size=Is, device=device)
    x = torch.randn(T, H, device=device).to(torch.bfloat16).requires_grad_(True)
    top = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, K, device=device), dim=-1).requires_grad_(True)
    d_out = torch.randn(T, H, device=device).to(torch.bfloat16)

    def forward():
        with torch.no_grad():
            module(x, top, weights)

    leaves = [x, weights, *module.parameters()]

    def step():
        for leaf in leaves:  # assigned, not accumulated: no extra pass over the weights
            leaf.grad = None
        out = module(x, top, weights)
        out.backward(d_out)

    forward()
    step()
    layer = next(iter(module.workspace._layers.values()))
    out = torch.empty(T, H, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    params = [module.w_gate, module.w_up, module.w_down, module.w_shared_gate, module.w_shared_up,
              module.w_shared_down]

    def capsules(tensors):
        return [None if t is None else to_dlpack(t.detach()) for t in tensors]

    grads = [torch.empty_like(t) for t in (x, weights, *params[:3])]
    shared_grads = [torch.empty_like(p) if p is not None else None for p in params[3:]]

    def native_forward():
        return layer.forward(*capsules([x, top, weights, *params, out]), stream)

    def native_step():
        context = native_forward()
        layer.backward(*capsules([x, top, weights, *params, d_out, *grads, *shared_grads]), stream, context)

    result = {"shape": shape_name, "T": T, "H": H, "I": I, "E": E, "K": K, "Is": Is}
    flop_forward = 6.0 * T * K * H * I + 6.0 * T * H * Is
    for name, fn, flop in (
        ("torch forward", forward, flop_forward),
        ("torch forward+backward", step, 3 * flop_forward),
        ("C++ forward", native_forward, flop_forward),
        ("C++ forward+backward", native_step, 3 * flop_forward),
    ):
        for mode in ("per call", "sustained"):
            ms = _time(fn, calls, mode == "sustained")
            result[f"{name}, {mode}"] = {"ms": ms, "tflops": flop / ms / 1e9}
    module.workspace.synchronize()
    module.workspace.release()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"mok bench (Python): {args.shape} on {torch.cuda.get_device_name()}", flush=True)
    result = run(args.shape, args.calls, args.seed)
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"  {key:<40} {value['ms']:9.3f} ms {value['tflops']:8.1f} TFLOP/s", flush=True)
    for direction in ("forward", "forward+backward"):
        for mode in ("per call", "sustained"):
            torch_ms = result[f"torch {direction}, {mode}"]["ms"]
            native_ms = result[f"C++ {direction}, {mode}"]["ms"]
            print(f"  torch / C++, {direction}, {mode}: {torch_ms / native_ms:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
