"""Energy a call of mok's layer, bf16 against FP8, sustained, from the card's energy counter.

    python3 scripts/energy_per_call.py --shape dsv3_local [--seconds 4] [--rounds 2]

Why: the FP8 GEMMs' rate a CTA a clock is flat from 44 to 132 CTAs (docs/perf.md, session 67),
so with every SM busy their time is the clock the card allows. If that clock is set by the power
limit, a call's time under sustained load is its energy over the limit's watts, and FP8's
ratio to bf16 is the ratio of their energies. This measures, for each precision and direction
(the forward under no_grad, and forward + backward, as `python -m mok.bench` times them), calls
queued back to back for about `--seconds`: ms a call, joules a call (NVML's total energy
counter read before and after, the calls synchronized), the mean watts, the SM clock
(`mok._C.SmClockWindow`), and the share of samples (every 10 ms, from a thread) in which NVML
named each reason for holding the clock down. The idle card's watts are measured first.
Needs the package installed (scripts/setup-python.sh) and the driver's libnvidia-ml.so.1.
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time
from dataclasses import replace
from statistics import median

import torch

from mok import _C
from mok.bench import _callables
from mok.bench_peers import _mok_config_system, make_problem

# nvmlClocksEventReasons bits (nvml.h) worth naming here.
REASONS = {
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "hw power brake",
}


class Nvml:
    """The few NVML calls this needs, through ctypes (no pynvml on the GPU machine)."""

    def __init__(self, index: int) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(
            self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)),
            f"nvmlDeviceGetHandleByIndex_v2({index})",
        )

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned NVML status {status}")

    def millijoules(self) -> int:
        value = ctypes.c_ulonglong()
        self._check(
            self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)),
            "nvmlDeviceGetTotalEnergyConsumption",
        )
        return value.value

    def reasons(self) -> int:
        # The newer name first; drivers before 535 export only the older one.
        name = "nvmlDeviceGetCurrentClocksEventReasons"
        if not hasattr(self.lib, name):
            name = "nvmlDeviceGetCurrentClocksThrottleReasons"
        value = ctypes.c_ulonglong()
        self._check(getattr(self.lib, name)(self.handle, ctypes.byref(value)), name)
        return value.value


class ReasonSampler:
    """Counts, every 10 ms while open, the samples in which each REASONS bit was set."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml, self.samples, self.counts = nvml, 0, {bit: 0 for bit in REASONS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            bits = self.nvml.reasons()
            self.samples += 1
            for bit in REASONS:
                self.counts[bit] += bool(bits & bit)
            time.sleep(0.01)

    def __enter__(self) -> "ReasonSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        shares = [
            f"{name} {100 * self.counts[bit] / self.samples:.0f}%"
            for bit, name in REASONS.items()
            if self.samples and self.counts[bit]
        ]
        return ", ".join(shares) or "none"


def measure(nvml: Nvml, run, seconds: float) -> dict:
    """Calls of `run` queued back to back for about `seconds` (the count from a timed first
    batch), synchronized once: ms a call, J a call, mean W, SM clock, clock-holding reasons."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    calls = max(10, int(seconds / ((time.perf_counter() - start) / 5)))
    clock = _C.SmClockWindow()
    stream = torch.cuda.current_stream().cuda_stream
    with ReasonSampler(nvml) as sampler:
        energy_start = nvml.millijoules()
        start = time.perf_counter()
        clock.open(stream)
        for _ in range(calls):
            run()
        clock.close(stream)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        energy = (nvml.millijoules() - energy_start) / 1000.0
    return {
        "calls": calls,
        "ms": 1000.0 * elapsed / calls,
        "joules": energy / calls,
        "watts": energy / elapsed,
        "ghz": clock.ghz(),
        "reasons": sampler.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="dsv3_local")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    device = torch.device("cuda")
    nvml = Nvml(torch.cuda.current_device())
    energy_start, start = nvml.millijoules(), time.perf_counter()
    time.sleep(2.0)
    idle_watts = (nvml.millijoules() - energy_start) / 1000.0 / (time.perf_counter() - start)
    print(f"{args.shape}, {torch.cuda.get_device_name()}, idle {idle_watts:.0f} W", flush=True)

    p = make_problem(args.shape, device)
    callables = {}
    for precision in ("bf16", "fp8_block"):
        config = replace(p.module.config, precision=precision)
        system = _mok_config_system(p, f"mok {precision}", config)
        forward, step, release = _callables(p, system)
        callables[precision] = (forward, step, release)
    results: dict[tuple[str, str], list[dict]] = {}
    for round_idx in range(args.rounds):
        # Each round starts with the other precision, so neither always runs on a cooler card.
        order = ("bf16", "fp8_block") if round_idx % 2 == 0 else ("fp8_block", "bf16")
        for direction_idx, direction in enumerate(("forward, no_grad", "forward + backward")):
            for precision in order:
                run = callables[precision][direction_idx]
                result = measure(nvml, run, args.seconds)
                callables[precision][2]()
                results.setdefault((direction, precision), []).append(result)
                print(
                    f"round {round_idx} {direction:19s} {precision:9s} {result['calls']:4d} calls"
                    f" {result['ms']:7.3f} ms {result['joules']:6.3f} J a call"
                    f" {result['watts']:4.0f} W {result['ghz']:.2f} GHz"
                    f" clock held by: {result['reasons']}",
                    flush=True,
                )
    print("\nmedian over rounds: FP8 against bf16")
    for direction in ("forward, no_grad", "forward + backward"):
        medians = {}
        for precision in ("bf16", "fp8_block"):
            rows = results[(direction, precision)]
            medians[precision] = {key: median(r[key] for r in rows) for key in ("ms", "joules")}
        bf16, fp8 = medians["bf16"], medians["fp8_block"]
        print(
            f"  {direction:19s} time {bf16['ms']:.3f} / {fp8['ms']:.3f} ms = "
            f"{bf16['ms'] / fp8['ms']:.2f}x, energy {bf16['joules']:.3f} / {fp8['joules']:.3f} J"
            f" = {bf16['joules'] / fp8['joules']:.2f}x"
        )


if __name__ == "__main__":
    main()
