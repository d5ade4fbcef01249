"""Per-kernel GPU times of mok's layer under sustained load, from torch.profiler.

    python3 scripts/kernel_times.py --shape dsv3_local --precision fp8_block [--calls 20]

Runs `--calls` calls back to back (one synchronization at the end, as a training loop and
`python -m mok.bench`'s sustained timing do) of each direction: the forward under no_grad (the
benchmark's forward: no context kept), the forward with autograd recording (the training
forward: the context kept), and forward + backward. Prints each kernel's mean time per call, its
launches per call and its share of the direction's kernel time, largest first; then the GPU's
span per call, the SM clock the calls ran at, and where it sat idle (the gaps before each
kernel's launches, no kernel of the run on the GPU). The clocks are the card's own (no ncu
replay, no locked clocks), so the times are those a training loop sees. `--native` adds the C++
layer called directly, first. `--weight-grad-forms` (fp8_block) adds MoK's forward and backward
(``mok.functional``) with the weight gradients into given bf16 tensors, into fp32 ones, and
accumulated into fp32 main gradients: what each form costs. Needs the package installed
(scripts/setup-python.sh).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from mok import _C
from mok.bench import _callables
from mok.bench_peers import _mok_config_system, _mok_systems, make_problem
from mok import functional as F
from mok.functional import MoKConfig


def kernel_table(run, calls: int):
    """Over `calls` calls of `run`: [(kernel name, microseconds per call, launches per call)],
    the GPU's span per call (first kernel's start to last kernel's end, over the calls),
    [(kernel name, idle microseconds before its launches, per call)] (the gaps in which no
    kernel of the run was on the GPU), and the SM clock in GHz the calls ran at."""
    run()
    torch.cuda.synchronize()
    clock = _C.SmClockWindow()
    stream = torch.cuda.current_stream().cuda_stream
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        clock.open(stream)
        for _ in range(calls):
            run()
        clock.close(stream)
        torch.cuda.synchronize()
    total_us: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.time_range.elapsed_us()
            launches[event.name] += 1
            spans.append((event.time_range.start, event.time_range.end, event.name))
    rows = [(name, us / calls, launches[name] / calls) for name, us in total_us.items()]
    spans.sort()
    gap_us: dict[str, float] = defaultdict(float)
    busy_until = spans[0][1] if spans else 0
    for start, end, name in spans[1:]:
        if start > busy_until:
            gap_us[name] += start - busy_until
        busy_until = max(busy_until, end)
    span = (busy_until - spans[0][0]) / calls if spans else 0.0
    gaps = sorted(((name, us / calls) for name, us in gap_us.items()), key=lambda g: -g[1])
    return sorted(rows, key=lambda row: -row[1]), span, gaps, clock.ghz()


def config_fields(settings: list[str]) -> dict:
    """`FIELD=VALUE` strings as MoKConfig fields, each VALUE read as its field's type."""
    defaults = MoKConfig()
    fields = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if not hasattr(defaults, name):
            raise SystemExit(f"--set {setting}: MoKConfig has no field {name!r}")
        kind = type(getattr(defaults, name))
        fields[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return fields


def short_name(name: str, width: int = 90) -> str:
    name = name.replace("mok::kernels::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def functional_step(p, config: MoKConfig, form: str):
    """MoK's forward then backward on `p` (its schedule built each call, as a training step
    does), the weight gradients into tensors of `form`: "bf16", "fp32", or "fp32 accumulated"
    (added to fp32 main gradients)."""
    module = p.module
    T, H = p.x.shape
    workspace = F.get_workspace(
        config, None, device=p.x.device, num_local_tokens=T, hidden_size=H, topk=p.K
    )
    workspace.weights_version = "auto"  # FP8: weights kept between calls, as in mok.bench
    shared = [getattr(module, f"w_shared_{n}", None) for n in ("gate", "up", "down")]
    routed = [module.w_gate, module.w_up, module.w_down]
    weights = [w.detach() if w is not None else None for w in shared + routed]
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    grads = tuple(
        torch.zeros(w.shape, dtype=dtype, device=w.device)
        for w in weights[3:] + weights[:3]
        if w is not None
    )

    def run():
        schedule = F.build_schedule(workspace, config, p.top_experts, num_local_experts=p.E)
        out, context = F.forward(config, workspace, schedule, p.x, p.router_weights, *weights)
        F.backward(
            config, workspace, schedule, context, p.d_out, p.x, p.router_weights, *weights,
            weight_grads=grads, accumulate_weight_grads=form == "fp32 accumulated",
        )  # fmt: skip

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="dsv3_local")
    parser.add_argument("--precision", default="bf16", help="bf16 or fp8_block")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--native",
        action="store_true",
        help="also the C++ layer called directly, first (the benchmark's `mok C++`: no autograd)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a MoKConfig field for mok's layer (repeatable), e.g. fp8_swiglu=pass",
    )
    parser.add_argument(
        "--weight-grad-forms",
        action="store_true",
        help="fp8_block: also steps through mok.functional with the weight gradients into bf16, "
        "fp32 and accumulated fp32 tensors",
    )
    args = parser.parse_args()

    device = torch.device("cuda")
    p = make_problem(args.shape, device)
    config = replace(p.module.config, precision=args.precision, **config_fields(args.set))
    system = _mok_config_system(p, f"mok {args.precision}", config)
    # The benchmark's own calls (warmed up by one step): the forward under no_grad, the step.
    forward_no_grad, step, release = _callables(p, system)
    x = p.x.detach().requires_grad_(True)
    weights = p.router_weights.detach().requires_grad_(True)

    def forward_recorded():  # the training forward: the context kept, the graph dropped
        system.forward(x, p.top_experts, weights)

    print(f"{args.shape}, {args.precision}, {torch.cuda.get_device_name()}, {args.calls} calls")
    directions = [
        ("forward, no_grad", forward_no_grad),
        ("forward, recorded", forward_recorded),
        ("forward + backward", step),
    ]
    if args.native:  # first, so that a card warmed by the others does not slow it alone
        native = next(c for c in _mok_systems(p) if c.native_step is not None)
        native_forward, native_step, _ = _callables(p, native)
        directions = [
            ("C++ layer: forward", native_forward),
            ("C++ layer: forward + backward", native_step),
            *directions,
        ]
    if args.weight_grad_forms:
        directions += [
            (f"mok.functional step, weight gradients {form}", functional_step(p, config, form))
            for form in ("bf16", "fp32", "fp32 accumulated")
        ]
    for title, run in directions:
        rows, span, gaps, ghz = kernel_table(run, args.calls)
        total = sum(us for _, us, _ in rows)
        print(
            f"\n{title}: {total / 1000:.3f} ms of kernels a call, the GPU's span "
            f"{span / 1000:.3f} ms a call (idle {100 * (1 - total / span) if span else 0:.1f}%), "
            f"SM clock {ghz:.2f} GHz"
        )
        for name, us, count in rows:
            if us < 0.005 * total:
                continue
            print(
                f"  {us / 1000:8.3f} ms  {count:4.1f}x  {100 * us / total:5.1f}%  {short_name(name)}"
            )
        print("  idle before (per call):")
        for name, us in gaps[:8]:
            print(f"  {us / 1000:8.3f} ms  {short_name(name)}")
        release()


if __name__ == "__main__":
    main()
