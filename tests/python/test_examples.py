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
