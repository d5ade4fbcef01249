"""scripts/router_grad_order.py: the router weights' gradient order walked as the lane-per-vector
kernels, the down dgrad's SwiGLU epilogue and the FP8 pass walk it gives the same float32 bits
(no GPU needed; the GPU tests check the kernels themselves against each other)."""

import numpy as np
from repo_scripts import load_script


def test_the_three_walks_agree_bitwise():
    assert load_script("router_grad_order").mismatches(rows=120, seed=7) == []


def test_the_bits_tell_orders_apart():
    """The check above can fail: on the same rows a running sum over the columns gives other
    bits than the tree for most rows."""
    order = load_script("router_grad_order")
    rng = np.random.default_rng(3)
    differ = 0
    for _ in range(20):
        e = order.random_row(rng, 512)
        running = np.float32(0)
        for value in e:
            running = np.float32(running + value)
        differ += running.tobytes() != order.lane_walk(e).tobytes()
    assert differ >= 10
