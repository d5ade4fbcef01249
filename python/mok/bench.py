"""``python -m mok.bench``: mok against the systems its users would pick instead, on one GPU.

    python -m mok.bench --shapes qwen3,dsv3_local,sonic_e128,dsv3_e128,dsv3 --shared dsv3_local \\
        --json out/bench.json --plot out/bench.png

Per shape, in one process on the same tensors (``bench_peers``: mok through PyTorch, the C++
layer, transformers' experts with ``"mok"`` and ``"grouped_mm"``, the torch ``grouped_mm``
pipeline, and SonicMoE when importable), each system's forward and forward + backward, timed
per call (median of synchronized calls) and sustained (calls queued back to back, one
synchronization: a training loop), in rounds: each round times every direction and mode for all
systems one after another, starting one system later each round, so that none always runs first
on a cool card; the median over rounds is reported, and each system's time over mok's as the
median of the rounds' ratios, with the SM clock each ran at (``_C.SmClockWindow``: probes on
the device before and after). Prints ms, TFLOP/s, those ratios and the clocks, and writes JSON
and a plot (TFLOP/s per shape and system, sustained, forward and forward + backward), both
rewritten after every shape, so that a run cut short keeps the shapes it finished.

    python -m mok.bench --from-json run1.json,run2.json --json all.json --plot all.png

prints earlier runs' tables (their ``--json`` files, or ``scripts/gpu-check.sh``'s results.json)
and merges them, one result per shape, into one JSON and one plot, without a GPU: the shapes of
a judging benchmark that did not fit one device call, shown together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from .bench_peers import SYSTEM_NAMES, Problem, System, make_problem, systems_of

DIRECTIONS = ("forward", "forward+backward")
_START = time.monotonic()


def progress(message: str) -> None:
    """A line with the seconds since the module loaded, flushed: a run cut off by a time limit
    still says which system or round its time went to."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


MODES = ("per call", "sustained")


def _time(fn, calls: int, sustained: bool, clock) -> tuple[float, float]:
    """Milliseconds per call, and the SM clock in GHz the calls ran at (`clock`, an
    `_C.SmClockWindow`: probes before and after on the device; the median over the calls per
    call). On the power-limited card a system's sustained time is its work per cycle over the
    clock its power draw leaves, so the clock tells the two apart."""
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    if sustained:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clock.open(stream)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        clock.close(stream)
        end.synchronize()
        return start.elapsed_time(end) / calls, clock.ghz()
    times, clocks = [], []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clock.open(stream)
        start.record()
        fn()
        end.record()
        clock.close(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
        clocks.append(clock.ghz())
    return statistics.median(times), statistics.median(clocks)


def _callables(p: Problem, system: System):
    """(forward, forward+backward, release) of one system, each a call with no arguments;
    release drops the gradients a step left (so that only one system holds them at a time)."""
    if system.native_step is not None:
        return system.native_forward, system.native_step, lambda: None
    x = p.x.detach().clone().requires_grad_(True)
    weights = p.router_weights.detach().clone().requires_grad_(True)
    leaves = [x, weights, *system.parameters]

    def forward():
        with torch.no_grad():
            system.forward(x, p.top_experts, weights)

    def step():
        for leaf in leaves:  # assigned, not accumulated: no extra pass over the weights
            leaf.grad = None
        system.forward(x, p.top_experts, weights).backward(p.d_out)

    def release():
        for leaf in leaves:
            leaf.grad = None

    step()  # warm-up: workspaces, autotuning, caches
    release()
    return forward, step, release


def measurement_order(names: list[str], rounds: int) -> list[tuple[int, str, str, str]]:
    """(round, direction, mode, system) in the order they are timed: in each round every
    direction and mode is timed for all systems one after another (so the systems compared in
    one round see the card in about the same state), starting each round one system later."""
    order = []
    for round_idx in range(rounds):
        shift = round_idx % max(len(names), 1)
        rotated = names[shift:] + names[:shift]
        for direction in DIRECTIONS:
            for mode in MODES:
                order += [(round_idx, direction, mode, name) for name in rotated]
    return order


def run_shape(p: Problem, systems: list[System], calls: int, rounds: int) -> dict:
    timed = {}
    for system in systems:
        progress(f"{p.shape_name}: {system.name}: first step (warm-up, autotuning)")
        try:
            timed[system.name] = _callables(p, system)
        except Exception as error:  # a peer (or a new mok path) that fails here is left out
            if system.name == "mok":
                raise
            p.skipped[system.name] = f"failed: {type(error).__name__}: {error}"[:300]
            torch.cuda.synchronize()
    from . import _C

    clock = _C.SmClockWindow()
    samples: dict[str, list[float]] = {}
    clocks: dict[str, list[float]] = {}
    last_round = -1
    for round_idx, direction, mode, name in measurement_order(list(timed), rounds):
        if round_idx != last_round:
            progress(f"{p.shape_name}: round {round_idx + 1} of {rounds}")
            last_round = round_idx
        fn = timed[name][DIRECTIONS.index(direction)]
        ms, ghz = _time(fn, calls, mode == "sustained", clock)
        samples.setdefault(f"{name}|{direction}|{mode}", []).append(ms)
        clocks.setdefault(f"{name}|{direction}|{mode}", []).append(ghz)
        timed[name][2]()  # its gradients go before the next system runs
    p.module.workspace.synchronize()  # raises what the device found
    result = {
        "shape": p.shape_name,
        "T": p.T,
        "H": p.H,
        "I": p.I,
        "E": p.E,
        "K": p.K,
        "Is": p.Is,
        "rounds": rounds,
        "calls": calls,
        "skipped": p.skipped,
        "systems": {},
    }
    for key, values in samples.items():
        name, direction, mode = key.split("|")
        ms = statistics.median(values)
        flop = p.flop_forward * (3 if direction == "forward+backward" else 1)
        mok_values = samples[f"mok|{direction}|{mode}"]
        entry = result["systems"].setdefault(name, {})
        entry[f"{direction}, {mode}"] = {
            "ms": ms,
            "tflops": flop / ms / 1e9,
            "rounds_ms": values,
            # The median of the rounds' ratios: each pairs two systems timed moments apart.
            "over_mok": statistics.median(v / m for v, m in zip(values, mok_values)),
            "ghz": statistics.median(clocks[key]),
        }
    return result


def print_table(result: dict) -> None:
    systems = result["systems"]
    print(
        f"{result['shape']} (T={result['T']} H={result['H']} I={result['I']} E={result['E']} "
        f"K={result['K']} Is={result['Is']}), median of {result['rounds']} rotated rounds",
        flush=True,
    )
    print(f"  {'system':<18} {'':<28} {'ms':>9} {'TFLOP/s':>9} {'time / mok':>11} {'GHz':>6}")
    print(
        "  (ms: median of the rounds; time / mok: median of the rounds' ratios; GHz: the SM"
        " clock the calls ran at)"
    )
    for name, entries in systems.items():
        for key, value in entries.items():
            ratio = value["over_mok"]
            ghz = f"{value['ghz']:6.2f}" if value.get("ghz") else f"{'':>6}"
            print(
                f"  {name:<18} {key:<28} {value['ms']:9.3f} {value['tflops']:9.1f} {ratio:10.2f}x"
                f" {ghz}"
            )
    for name, why in result["skipped"].items():
        print(f"  {name:<18} skipped: {why}")


def plot(results: list[dict], path: str) -> None:
    """TFLOP/s per shape and system, sustained: forward and forward + backward side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for result in results:
        names += [n for n in result["systems"] if n not in names]
    figure, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    width = 0.8 / max(len(names), 1)
    for axis, direction in zip(axes, DIRECTIONS):
        for i, name in enumerate(names):
            heights = [
                r["systems"].get(name, {}).get(f"{direction}, sustained", {}).get("tflops", 0.0)
                for r in results
            ]
            axis.bar([x + i * width for x in range(len(results))], heights, width, label=name)
        axis.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(results))])
        axis.set_xticklabels([r["shape"] for r in results], rotation=20)
        axis.set_title(f"{direction}, sustained")
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (bf16)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(names), fontsize=9)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def load_results(path: str) -> tuple[str, list[dict]]:
    """(device, results) of an earlier run: the JSON this module's ``--json`` writes, or
    ``scripts/gpu-check.sh``'s results.json, which holds it under ``python.bench``."""
    with open(path) as f:
        data = json.load(f)
    python = data.get("python") if isinstance(data, dict) else None
    if isinstance(python, dict) and isinstance(python.get("bench"), dict):
        data = python["bench"]
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(
            f"--from-json: {path!r} holds no benchmark results (expected this module's --json "
            "output, with a 'results' list, or gpu-check.sh's results.json with 'python.bench')"
        )
    return str(data.get("device", "unknown device")), data["results"]


def merge_results(paths: list[str]) -> tuple[list[str], list[dict]]:
    """The results of several runs in file order, one per shape: a later file's result for a
    shape replaces an earlier one's. Each result keeps its run's device and file under
    ``source``; ratios hold within a run, so the tables print them per shape as measured."""
    devices, merged = [], {}
    for path in paths:
        device, results = load_results(path)
        if device not in devices:
            devices.append(device)
        for result in results:
            shape = result["shape"]
            if shape in merged:
                print(f"{shape}: {path} replaces {merged[shape]['source']['file']}", flush=True)
            merged[shape] = {**result, "source": {"file": path, "device": device}}
    return devices, list(merged.values())


def _install_sonic_precompile(path: str, workers: int = 14) -> None:
    """Loads the peers' SonicMoE benchmark module from ``path`` and installs its parallel
    pre-compile of QuACK's autotuning candidates (which configs and which wins stay QuACK's)."""
    import importlib.util

    try:
        import quack.autotuner  # noqa: F401  (only where SonicMoE is importable)
    except ImportError:
        return
    spec = importlib.util.spec_from_file_location("peers_sonic_bench", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--sonic-precompile: {path!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_parallel_precompile(workers)
    print(f"SonicMoE: QuACK's candidates pre-compiled by {workers} workers ({path})", flush=True)


def report_from_json(paths: list[str], json_path: str | None, plot_path: str | None) -> None:
    """``--from-json``: earlier runs' tables, merged JSON and plot; no GPU needed."""
    devices, results = merge_results(paths)
    print(f"mok bench (Python), from {len(paths)} file(s), measured on {', '.join(devices)}")
    if len(devices) > 1:
        print("  (different devices: compare systems within a shape, not shapes across runs)")
    for result in results:
        print(f"{result['source']['file']} ({result['source']['device']}):")
        print_table(result)
    write_outputs(results, ", ".join(devices), json_path, plot_path)


def write_outputs(
    results: list[dict], device: str, json_path: str | None, plot_path: str | None
) -> None:
    """The results as JSON (what ``--from-json`` reads back) and as a plot, where asked."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": device, "results": results}, f, indent=1)
    if plot_path:
        plot(results, plot_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3", help="comma-separated named shapes")
    parser.add_argument("--shape", default=None, help="one shape (the same as --shapes NAME)")
    parser.add_argument(
        "--shared", default="", help="shapes also run with a shared expert of width I (mok only)"
    )
    parser.add_argument("--no-peers", action="store_true", help="mok and its C++ layer only")
    parser.add_argument(
        "--systems",
        default="",
        help="comma-separated systems to run (default: all that run here; mok always): "
        + ", ".join(SYSTEM_NAMES),
    )
    parser.add_argument("--fp8", action="store_true", help="also mok in FP8 (fp8_block)")
    parser.add_argument(
        "--knobs",
        default="",
        help="comma-separated MoKConfig switches, each timed flipped beside mok on the same "
        "weights (e.g. gemm_cta_pairs,weight_grad_pingpong); FIELD=N sets an integer field, "
        "FIELD=VALUE a text one, and K1+K2 applies several on one layer (e.g. "
        "gemm_four_stages+gemm_lockstep_k_blocks=16, precision=fp8_block+fp8_swiglu=pass)",
    )
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of TFLOP/s per shape and system")
    parser.add_argument(
        "--from-json",
        default="",
        help="comma-separated results of earlier runs (--json files, or gpu-check.sh's "
        "results.json): prints their tables and writes --json / --plot from them, one per "
        "shape (a later file's replaces an earlier one's), without running anything",
    )
    parser.add_argument(
        "--sonic-precompile",
        default=os.environ.get("MOK_BENCH_SONIC_PRECOMPILE", ""),
        help="the peers' sonic_bench.py: its shared pool compiles QuACK's autotuning candidates "
        "in parallel (SonicMoE's first call takes minutes without it); the tuning is QuACK's",
    )
    args = parser.parse_args()
    if args.from_json:
        report_from_json([p for p in args.from_json.split(",") if p], args.json, args.plot)
        return
    if args.sonic_precompile:
        _install_sonic_precompile(args.sonic_precompile)
    shapes = [args.shape] if args.shape else [s for s in args.shapes.split(",") if s]
    only = {s.strip() for s in args.systems.split(",") if s.strip()} or None
    runs = [(s, None) for s in shapes] + [(s, "I") for s in args.shared.split(",") if s]
    device = torch.device("cuda")
    print(f"mok bench (Python) on {torch.cuda.get_device_name()}", flush=True)
    results = []

    for shape_name, shared in runs:
        from . import _C

        width = _C.named_shape(shape_name).intermediate if shared else None
        problem = make_problem(shape_name, device, args.seed, shared=width)
        result = run_shape(
            problem,
            systems_of(
                problem,
                peers=not args.no_peers,
                fp8=args.fp8,
                only=only,
                knobs=[k.strip() for k in args.knobs.split(",") if k.strip()],
            ),
            args.calls,
            args.rounds,
        )
        print_table(result)
        results.append(result)
        # After every shape: a run cut short keeps what it measured.
        write_outputs(results, torch.cuda.get_device_name(), args.json, args.plot)
        problem.module.workspace.release()
        del problem
        torch.cuda.empty_cache()
    if "sonicmoe" in sys.modules:
        # With SonicMoE's libraries loaded the interpreter's exit failed after every result was
        # written (H200, session 10): leave without its teardown so the exit status is ours.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
