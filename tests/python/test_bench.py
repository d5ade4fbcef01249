"""The benchmark's parts that run without a GPU: the torch grouped_mm peer computes the layer
(against the float64 torch implementation, outputs and gradients), the plot is drawn from a
result (a PNG with one bar group per shape), and earlier runs' results merge into one report."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import as_float64, cuda_reason, make_problem, relative_error, torch_moe
from mok.bench import plot
from mok.bench_peers import torch_grouped_mm_moe


def check_peer_against_float64(peer, seed, d_out_seed, T, tolerance):
    """Runs `peer(x, top_experts, router_weights, gate_up, down)` forward and backward on a small
    problem and compares its output and every gradient with the float64 torch layer."""
    p = make_problem("cpu", T=T, E=4, K=2, seed=seed)
    p["top_experts"] = p["top_experts"].long()
    gate_up = torch.cat((p["w_gate"], p["w_up"]), dim=1).requires_grad_(True)
    down = p["w_down"].clone().requires_grad_(True)
    x = p["x"].clone().requires_grad_(True)
    weights = p["router_weights"].clone().requires_grad_(True)
    out = peer(x, p["top_experts"], weights, gate_up, down)
    generator = torch.Generator().manual_seed(d_out_seed)
    d_out = torch.randn(out.shape, generator=generator).to(torch.bfloat16)
    out.backward(d_out)
    exact = as_float64(p, requires_grad=True)
    expected = torch_moe(exact)
    expected.backward(d_out.double())
    assert relative_error(out, expected) < tolerance
    assert relative_error(x.grad, exact["x"].grad) < tolerance
    assert relative_error(weights.grad, exact["router_weights"].grad) < tolerance
    expected_gate_up = torch.cat((exact["w_gate"].grad, exact["w_up"].grad), dim=1)
    assert relative_error(gate_up.grad, expected_gate_up) < tolerance
    assert relative_error(down.grad, exact["w_down"].grad) < tolerance


def test_torch_grouped_mm_peer_computes_the_layer():
    check_peer_against_float64(torch_grouped_mm_moe, seed=9, d_out_seed=4, T=40, tolerance=1e-2)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    entry = lambda tflops: {"ms": 1.0, "tflops": tflops, "rounds_ms": [1.0]}  # noqa: E731
    results = [
        {
            "shape": shape,
            "systems": {
                name: {
                    f"{d}, {m}": entry(100.0 * (i + 1))
                    for d in ("forward", "forward+backward")
                    for m in ("per call", "sustained")
                }
                for i, name in enumerate(["mok", "hf grouped_mm"])
            },
        }
        for shape in ("qwen3", "dsv3_local")
    ]
    path = tmp_path / "bench.png"
    plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_every_system_of_a_problem_computes_the_same_layer():
    """On the CPU (mok's reference, transformers' experts, the torch pipeline; sonicmoe skipped
    when not importable): the systems the benchmark times agree on the output and gradients."""
    pytest.importorskip("transformers")
    from mok.bench import _callables
    from mok.bench_peers import make_problem as bench_problem
    from mok.bench_peers import peer_weights, systems_of

    p = bench_problem("tiny", torch.device("cpu"), seed=1)
    systems = systems_of(p)
    names = [s.name for s in systems]
    assert set(names) >= {"mok", "hf mok", "hf grouped_mm", "torch grouped_mm"}, names
    shared = peer_weights(p)
    for peer in (s for s in systems if not s.name.startswith("mok")):
        assert len(peer.parameters) == 2, peer.name
        assert all(a is b for a, b in zip(peer.parameters, shared)), (
            f"{peer.name} steps on a copy of the weights, not the peers' one pair"
        )
    results = []
    for system in systems:
        x = p.x.clone().requires_grad_(True)
        weights = p.router_weights.clone().requires_grad_(True)
        out = system.forward(x, p.top_experts, weights)
        out.backward(p.d_out)
        results.append((out.detach(), x.grad, weights.grad))
        forward, step, release = _callables(p, system)
        forward()
        step()
        release()
        assert all(leaf.grad is None for leaf in system.parameters), system.name
    for name, got in zip(names[1:], results[1:]):
        for a, b in zip(got, results[0]):
            assert relative_error(a, b) < 2e-2, name


def test_measurement_order_pairs_the_systems_in_every_round():
    """Each round times every (direction, mode) once per system, the systems back to back, and
    the round's first system moves on by one each round."""
    from mok.bench import DIRECTIONS, MODES, measurement_order

    names = ["mok", "mok C++", "sonicmoe"]
    order = measurement_order(names, rounds=4)
    assert len(order) == 4 * len(DIRECTIONS) * len(MODES) * len(names)
    for round_idx in range(4):
        in_round = [entry for entry in order if entry[0] == round_idx]
        assert in_round[0][3] == names[round_idx % len(names)]
        for position in range(0, len(in_round), len(names)):
            block = in_round[position : position + len(names)]
            assert len({(d, m) for _, d, m, _ in block}) == 1
            assert sorted(name for *_, name in block) == sorted(names)


def test_torch_fp8_peer_computes_the_layer(monkeypatch):
    """The torch FP8 pipeline's math on the CPU, with torch._scaled_grouped_mm (CUDA only)
    emulated by its definition (dequantized operands, one product per group): its output and
    gradients within FP8's error of the float64 layer."""
    from mok import bench_torch_fp8

    def emulated(a, b_kn, scale_a, scale_b, offsets):
        out, start = [], 0
        for group, end in enumerate(offsets.tolist()):
            lhs = a[start:end].float() * scale_a[start:end, None]
            rhs = b_kn[group].float() * scale_b[group][None, :]
            out.append(lhs @ rhs)
            start = end
        return torch.cat(out).to(torch.bfloat16)

    monkeypatch.setattr(bench_torch_fp8, "_scaled", emulated)
    check_peer_against_float64(
        bench_torch_fp8.torch_fp8_moe, seed=13, d_out_seed=2, T=64, tolerance=0.1
    )


def test_knob_systems_share_the_weights_and_compute_the_layer():
    """--knobs: each named MoKConfig switch becomes a system "mok KNOB" over the same weight
    tensors (not copies) that computes the same layer; an unknown knob lists the valid ones."""
    from mok.bench_peers import config_switches, systems_of
    from mok.bench_peers import make_problem as bench_problem

    assert {"gemm_cta_pairs", "weight_grad_pingpong", "skip_padding_rows"} <= set(config_switches())
    p = bench_problem("tiny", torch.device("cpu"), seed=2)
    systems = systems_of(p, peers=False, knobs=["gemm_cta_pairs", "skip_padding_rows"])
    assert [s.name for s in systems] == ["mok", "mok gemm_cta_pairs", "mok skip_padding_rows"]
    want = systems[0].forward(p.x, p.top_experts, p.router_weights)
    for system in systems[1:]:
        assert all(a is b for a, b in zip(system.parameters, systems[0].parameters)), system.name
        assert torch.equal(system.forward(p.x, p.top_experts, p.router_weights), want)
    with pytest.raises(ValueError, match="valid: .*gemm_cta_pairs"):
        systems_of(p, peers=False, knobs=["cta_pairs"])


def test_fp8_system_shares_the_weights_and_computes_the_layer_in_fp8():
    """--fp8: "mok fp8" steps on mok's own weight tensors (a copy held the weights twice: at
    dsv3_e128 FP8 did not fit beside the other systems on an 80 GB card) and computes the layer
    in FP8: within the format's error of mok's bf16, not its bits."""
    from mok.bench_peers import make_problem as bench_problem
    from mok.bench_peers import systems_of

    p = bench_problem("tiny", torch.device("cpu"), seed=3)
    systems = systems_of(p, peers=False, fp8=True)
    assert [s.name for s in systems] == ["mok", "mok fp8"]
    assert all(a is b for a, b in zip(systems[1].parameters, systems[0].parameters))
    want = systems[0].forward(p.x, p.top_experts, p.router_weights)
    got = systems[1].forward(p.x, p.top_experts, p.router_weights)
    assert not torch.equal(got, want)
    assert relative_error(got, want) < 0.1


def test_knobs_set_numbers_and_combine():
    """--knobs FIELD=N sets an integer field and K1+K2 applies several in turn; a name that is
    neither a switch nor an integer field is an error naming what is valid."""
    from mok.bench_peers import flipped_config
    from mok.functional import MoKConfig

    base = MoKConfig()
    both = flipped_config(base, "gemm_four_stages+gemm_lockstep_k_blocks=16")
    assert both.gemm_four_stages and both.gemm_lockstep_k_blocks == 16
    assert both.gemm_cta_pairs == base.gemm_cta_pairs
    assert flipped_config(base, "gemm_tile_group=3").gemm_tile_group == 3
    fp8 = flipped_config(base, "precision=fp8_block+fp8_swiglu=pass")
    assert fp8.precision == "fp8_block" and fp8.fp8_swiglu == "pass"
    with pytest.raises(ValueError, match="FIELD=N with FIELD one of .*gemm_lockstep_k_blocks"):
        flipped_config(base, "gemm_four_stages=2")
    with pytest.raises(ValueError, match="valid: .*gemm_four_stages"):
        flipped_config(base, "gemm_four_stages+lockstep")


def test_systems_filter_builds_only_those_asked_for():
    """--systems: only the named systems are built (mok always), the rest are reported as not
    asked for, and an unknown name is an error that lists the valid ones."""
    pytest.importorskip("transformers")
    from mok.bench_peers import make_problem as bench_problem
    from mok.bench_peers import systems_of

    p = bench_problem("tiny", torch.device("cpu"), seed=1)
    systems = systems_of(p, only={"hf grouped_mm"})
    assert [s.name for s in systems] == ["mok", "hf grouped_mm"]
    assert "torch grouped_mm" in p.skipped and "hf mok" in p.skipped
    with pytest.raises(ValueError, match="valid: mok"):
        systems_of(bench_problem("tiny", torch.device("cpu"), seed=1), only={"sonic"})


def _bench_result(shape: str, mok_ms: float) -> dict:
    """A result as `run_shape` returns it, for two systems."""
    entry = lambda ms: {"ms": ms, "tflops": 1.0 / ms, "rounds_ms": [ms], "over_mok": 1.0}  # noqa: E731
    systems = {
        name: {
            f"{d}, {m}": entry(mok_ms * factor)
            for d in ("forward", "forward+backward")
            for m in ("per call", "sustained")
        }
        for name, factor in (("mok", 1.0), ("sonicmoe", 1.1))
    }
    return {
        "shape": shape,
        "T": 8,
        "H": 16,
        "I": 8,
        "E": 4,
        "K": 2,
        "Is": 0,
        "rounds": 5,
        "calls": 20,
        "skipped": {},
        "systems": systems,
    }


def test_from_json_merges_earlier_runs_without_a_gpu(tmp_path, capsys):
    """`--from-json` reads this module's --json output and gpu-check.sh's results.json, keeps one
    result per shape (the later file's), prints the tables and writes the merged JSON and plot."""
    import json

    from mok.bench import main

    first = tmp_path / "bench.json"
    first.write_text(
        json.dumps(
            {
                "device": "H200",
                "results": [_bench_result("qwen3", 1.0), _bench_result("dsv3_local", 5.0)],
            }
        )
    )
    second = tmp_path / "results.json"
    second.write_text(
        json.dumps(
            {
                "ok": True,
                "python": {"bench": {"device": "H200", "results": [_bench_result("qwen3", 2.0)]}},
            }
        )
    )
    merged = tmp_path / "all.json"
    argv = ["mok.bench", "--from-json", f"{first},{second}", "--json", str(merged)]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(tmp_path / "all.png")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", argv)
        main()
    printed = capsys.readouterr().out
    assert f"qwen3: {second} replaces {first}" in printed
    assert "dsv3_local (T=8" in printed and "qwen3 (T=8" in printed
    results = json.loads(merged.read_text())["results"]
    assert [r["shape"] for r in results] == ["qwen3", "dsv3_local"]
    assert results[0]["systems"]["mok"]["forward, sustained"]["ms"] == 2.0
    assert results[0]["source"] == {"file": str(second), "device": "H200"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG"


def test_from_json_names_a_file_without_results(tmp_path):
    from mok.bench import load_results

    path = tmp_path / "other.json"
    path.write_text('{"ok": true}')
    with pytest.raises(ValueError, match="other.json.*holds no benchmark results"):
        load_results(str(path))


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
def test_sm_clock_window_reads_the_clock_around_work():
    """`_C.SmClockWindow` (the benchmark's GHz column) around a few large matmuls on the current
    stream reads a clock a Hopper card can run at, and its `_time` pairs it with the time."""
    from mok import _C
    from mok.bench import _time

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    window = _C.SmClockWindow()
    stream = torch.cuda.current_stream().cuda_stream
    window.open(stream)
    for _ in range(20):
        a @ a
    window.close(stream)
    ghz = window.ghz()
    assert 0.3 < ghz < 3.0, ghz
    for sustained in (False, True):
        ms, clock = _time(lambda: a @ a, 5, sustained, window)
        assert ms > 0 and 0.3 < clock < 3.0, (sustained, ms, clock)
