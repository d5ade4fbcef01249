"""``python -m mok.bench``: mok through PyTorch against mok's C++ layer and transformers' experts.

At a named shape (``mok shapes`` lists them) with uniformly random routing, on the same tensors
in one process, each case forward and forward + backward:

- ``mok.nn.MoE``: autograd over ``torch.ops.mok`` (the ops' dispatch, DLPack);
- ``C++``: the same layer called through ``mok._C`` directly (what PyTorch adds is the
  difference);
- ``hf mok`` / ``hf grouped_mm``: transformers' Qwen3-MoE experts module with
  ``experts_implementation="mok"`` and ``"grouped_mm"`` (what a transformers user runs today),
  when transformers is installed.

Timing: per call (median of synchronized calls) and sustained (calls queued back to back, one
synchronization: a training loop), in rounds that rotate the order of the cases, so that none
always runs first on a cool card; the median over rounds is reported. Prints a table with the
ratios to mok.nn.MoE and, with ``--json PATH``, writes the numbers.
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


def _hf_experts(implementation, w_gate, w_up, w_down, top_k):
    """transformers' Qwen3-MoE experts module holding the same weights, or None without it."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError:
        return None
    if implementation == "mok":
        import mok.integrations.transformers  # noqa: F401  registers "mok"
    E, I, H = w_gate.shape
    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k
    )
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config).to(w_gate.device, torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.cat([w_gate, w_up], dim=1))
        module.down_proj.copy_(w_down)
    return module


def _cases(shape_name: str, seed: int):
    """(name, forward, forward+backward) of every system, over the same tensors."""
    shape = _C.named_shape(shape_name)
    T, H, I, E, K, Is = (
        shape.num_tokens,
        shape.hidden,
        shape.intermediate,
        shape.num_experts,
        shape.top_k,
        shape.shared_intermediate,
    )
    torch.manual_seed(seed)
    device = torch.device("cuda")
    module = MoE(E, H, I, shared_intermediate_size=Is, device=device)
    x = torch.randn(T, H, device=device).to(torch.bfloat16).requires_grad_(True)
    top = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, K, device=device), dim=-1).requires_grad_(True)
    d_out = torch.randn(T, H, device=device).to(torch.bfloat16)
    cases = []

    def autograd_case(name, fn, parameters):
        leaves = [x, weights, *parameters]

        def forward():
            with torch.no_grad():
                fn(x, top, weights)

        def step():
            for leaf in leaves:  # assigned, not accumulated: no extra pass over the weights
                leaf.grad = None
            fn(x, top, weights).backward(d_out)

        step()  # builds the workspace, compiles nothing
        cases.append((name, forward, step))

    autograd_case("mok.nn.MoE", module, list(module.parameters()))
    layer = next(iter(module.workspace._layers.values()))
    params = [
        module.w_gate,
        module.w_up,
        module.w_down,
        module.w_shared_gate,
        module.w_shared_up,
        module.w_shared_down,
    ]
    out = torch.empty(T, H, device=device, dtype=torch.bfloat16)
    grads = [torch.empty_like(t) for t in (x, weights, *params[:3])]
    grads += [torch.empty_like(p) if p is not None else None for p in params[3:]]
    stream = torch.cuda.current_stream().cuda_stream

    def capsules(tensors):
        return [None if t is None else to_dlpack(t.detach()) for t in tensors]

    def native_forward():
        return layer.forward(*capsules([x, top, weights, *params, out]), stream)

    def native_step():
        context = native_forward()
        layer.backward(*capsules([x, top, weights, *params, d_out, *grads]), stream, context)

    cases.append(("C++", native_forward, native_step))
    if Is == 0:  # transformers' experts modules hold the routed experts only
        for implementation in ("mok", "grouped_mm"):
            hf = _hf_experts(
                implementation,
                module.w_gate.detach(),
                module.w_up.detach(),
                module.w_down.detach(),
                K,
            )
            if hf is not None:
                autograd_case(f"hf {implementation}", hf, list(hf.parameters()))
    flop_forward = 6.0 * T * K * H * I + 6.0 * T * H * Is
    info = {"shape": shape_name, "T": T, "H": H, "I": I, "E": E, "K": K, "Is": Is}
    return info, flop_forward, cases, module


def run(shape_name: str, calls: int, rounds: int, seed: int) -> dict:
    info, flop_forward, cases, module = _cases(shape_name, seed)
    samples: dict[str, list[float]] = {}
    for round_idx in range(rounds):
        order = cases[round_idx % len(cases) :] + cases[: round_idx % len(cases)]
        for name, forward, step in order:
            for direction, fn in (("forward", forward), ("forward+backward", step)):
                for mode in ("per call", "sustained"):
                    key = f"{name}, {direction}, {mode}"
                    samples.setdefault(key, []).append(_time(fn, calls, mode == "sustained"))
    module.workspace.synchronize()
    result = dict(info, rounds=rounds, calls=calls, systems=[name for name, _, _ in cases])
    for key, values in samples.items():
        ms = statistics.median(values)
        flop = flop_forward * (3 if "forward+backward" in key else 1)
        result[key] = {"ms": ms, "tflops": flop / ms / 1e9, "rounds_ms": values}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(
        f"mok bench (Python): {args.shape} on {torch.cuda.get_device_name()}, median of "
        f"{args.rounds} rotated rounds",
        flush=True,
    )
    result = run(args.shape, args.calls, args.rounds, args.seed)
    print(f"  {'':<44} {'ms':>9} {'TFLOP/s':>9} {'time / mok.nn.MoE':>18}")
    for key, value in result.items():
        if isinstance(value, dict):
            name, direction, mode = key.split(", ")
            reference = result[f"mok.nn.MoE, {direction}, {mode}"]["ms"]
            print(
                f"  {key:<44} {value['ms']:9.3f} {value['tflops']:9.1f} "
                f"{value['ms'] / reference:17.3f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
