"""The examples run as the README says, here on the CPU at small sizes (scripts/gpu-check.sh runs
them on CUDA at their default sizes): the training example's two runs print the same losses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def run_example(name, *args):
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_train_moe_block_is_reproducible():
    out = run_example(
        "train_moe_block.py",
        "--device",
        "cpu",
        "--steps",
        "4",
        "--seq",
        "32",
        "--hidden",
        "128",
        "--intermediate",
        "128",
        "--experts",
        "8",
        "--shared",
        "64",
        "--check-reproducible",
    )
    assert "two runs bitwise identical: yes" in out


def test_hf_qwen3_moe_example():
    pytest.importorskip("transformers")
    out = run_example("hf_qwen3_moe.py", "--device", "cpu")
    assert "loss: mok" in out and "logits relative difference" in out
    out = run_example("hf_qwen3_moe.py", "--device", "cpu", "--fp8")
    assert "loss: mok FP8" in out and "logits relative difference" in out


def test_train_moe_block_in_fp8_follows_bf16():
    """The training example in FP8 (the CPU reference's fp8_block) from the same start as bf16:
    the loss curves stay within 2% of each other over 60 steps (docs/perf.md has a 300-step run),
    and two FP8 runs print the same losses."""
    out = run_example(
        "train_moe_block.py",
        "--device",
        "cpu",
        "--steps",
        "60",
        "--seq",
        "32",
        "--batch",
        "2",
        "--hidden",
        "256",
        "--intermediate",
        "128",
        "--experts",
        "8",
        "--shared",
        "128",
        "--precision",
        "fp8_block",
        "--compare-bf16",
        "--check-reproducible",
        "--print-every",
        "1000",
    )
    assert "two runs bitwise identical: yes" in out
    gap = float(out.split("largest relative gap over the run ")[1].split("%")[0])
    assert gap < 2.0, out


def test_fp8_on_cuda_matches_the_cpu_reference():
    """The same FP8 module on CUDA (mok's FP8 kernels) and on the CPU (the FP8 reference): the
    output and every gradient within the bf16 tolerance; a shared expert and 128 tokens."""
    import torch

    import mok

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    config = mok.MoKConfig(precision="fp8_block")
    torch.manual_seed(3)
    cpu = mok.nn.MoE(8, 256, 128, shared_intermediate_size=128, config=config)
    cuda = mok.nn.MoE(8, 256, 128, shared_intermediate_size=128, device="cuda", config=config)
    with torch.no_grad():
        for a, b in zip(cpu.parameters(), cuda.parameters()):
            b.copy_(a)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(128, 256, generator=gen).to(torch.bfloat16)
    top = torch.randint(0, 8, (128, 2), generator=gen, dtype=torch.int32)
    weights = torch.softmax(torch.randn(128, 2, generator=gen), dim=-1)
    d_out = torch.randn(128, 256, generator=gen).to(torch.bfloat16)
    results = []
    for module, device in ((cpu, "cpu"), (cuda, "cuda")):
        xd = x.to(device).detach().requires_grad_(True)
        wd = weights.to(device).detach().requires_grad_(True)
        out = module(xd, top.to(device), wd)
        out.backward(d_out.to(device))
        grads = [xd.grad, wd.grad] + [p.grad for p in module.parameters()]
        results.append([t.detach().float().cpu() for t in [out, *grads]])
    for want, got in zip(*results):
        error = (got - want).norm() / want.norm().clamp_min(1e-30)
        assert error < 1e-2, float(error)
