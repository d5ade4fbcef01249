"""scripts/router_grad_order.py: the router weights' gradient order walked as the lane-per-vector
kernels, the down dgrad's SwiGLU epilogue and the FP8 pass walk it gives the same float32 bits
(no GPU needed; the GPU tests check the kernels themselves against each other)."""

import importlib.util
import pathlib

import numpy as np

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "router_grad_order.py"


def load():
    spec = importlib.util.spec_from_file_location("router_grad_order", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_three_walks_agree_bitwise():
    assert load().mismatches(rows=120, seed=7) == []


def test_the_bits_tell_orders_apart():
    """The check above can fail: on the same rows a running sum over the columns gives other
    bits than the tree for most rows."""
    order = load()
    rng = np.random.default_rng(3)
    differ = 0
    for _ in range(20):
        e = order.random_row(rng, 512)
        running = np.float32(0)
        for value in e:
            running = np.float32(running + value)
        differ += running.tobytes() != order.lane_walk(e).tobytes()
    assert differ >= 10
