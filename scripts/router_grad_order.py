"""The router weights' gradient order of swiglu_backward.cuh, walked three ways in float32.

d_router_weights[pair] = <dh_raw, h> over a row's I columns. Every GPU kernel that computes it
must add the products e_i = dh_raw_i * h_i in one order, or the layer's bits would depend on
the config (docs/design.md, backward step 2):
  1. an 8-column vector: ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7));
  2. a 256-column group's 32 vectors: a balanced tree, a warp's xor butterfly over lanes
     1, 2, 4, 8, 16 (vectors past the row's end count +0);
  3. the groups in column order from 0.
The kernels reach that order from different layouts. This script walks each layout as its
kernel does, so a change to one walk can be checked against the others without a GPU:
  lane_walk   the standalone pass and the persistent task: lane l holds vector l of a group;
  tile_walk   the down dgrad's SwiGLU epilogue (dgated_epilogue.cuh): per 32-column subtile a
              quad of lanes holds a row's four vectors and adds them (the tree's first two
              levels), the tree over the tile's eight subtiles stays in registers (open nodes
              closed by the subtile index's bits), one partial per 256-column tile, summed in
              column order after;
  fp8_walk    the FP8 SwiGLU pass (swiglu_backward_quantize.cu): a half-warp per row and
              128-column chunk, the even chunk's half of a group waiting for the odd one's.
Run it to check them on random rows (exit status 1 on a mismatch).
"""

import sys

import numpy as np

f32 = np.float32


def butterfly(values, offsets):
    values = list(values)
    for offset in offsets:
        values = [f32(values[lane] + values[lane ^ offset]) for lane in range(len(values))]
    return values


def vector_dot(e):
    return f32(f32(f32(e[0] + e[1]) + f32(e[2] + e[3])) + f32(f32(e[4] + e[5]) + f32(e[6] + e[7])))


def lane_walk(e):
    vectors = len(e) // 8
    total = f32(0)
    for group in range((vectors + 31) // 32):
        lanes = []
        for lane in range(32):
            v = 32 * group + lane
            lanes.append(vector_dot(e[8 * v : 8 * v + 8]) if v < vectors else f32(0))
        total = f32(total + butterfly(lanes, [1, 2, 4, 8, 16])[0])
    return total


def tile_walk(e):
    total = f32(0)
    for tile in range((len(e) + 255) // 256):
        columns = min(256, len(e) - 256 * tile)
        subtiles = (columns + 31) // 32
        open_nodes, tile_dot = [None] * 3, None
        for s in range(8):
            node = f32(0)  # past the row's end
            if s < subtiles:
                base = 256 * tile + 32 * s
                quad = [vector_dot(e[base + 8 * c : base + 8 * c + 8]) for c in range(4)]
                node = butterfly(quad, [1, 2])[0]
            if s & 1:
                node = f32(open_nodes[0] + node)
                if s & 2:
                    node = f32(open_nodes[1] + node)
                    if s & 4:
                        tile_dot = f32(open_nodes[2] + node)
                    else:
                        open_nodes[2] = node
                else:
                    open_nodes[1] = node
            else:
                open_nodes[0] = node
        total = f32(total + tile_dot)
    return total


def fp8_walk(e):
    chunks = len(e) // 128
    total, even = f32(0), f32(0)
    for chunk in range(chunks):
        slots = [vector_dot(e[8 * (16 * chunk + s) : 8 * (16 * chunk + s) + 8]) for s in range(16)]
        half = butterfly(slots, [1, 2, 4, 8])[0]
        if chunk % 2:
            total = f32(total + f32(even + half))
        else:
            even = half
    if chunks % 2:
        total = f32(total + f32(even + f32(0)))
    return total


def random_row(rng, columns, spread=0.0):
    """Products of one row: normal, scaled by e^U(-spread, spread), with a few signed zeros."""
    scale = np.exp(rng.uniform(-spread, spread, columns))
    e = (rng.standard_normal(columns) * scale).astype(np.float32)
    e[rng.integers(0, columns, 3)] = f32(-0.0)
    return e


def mismatches(rows=300, seed=1):
    rng = np.random.default_rng(seed)
    found = []
    for row in range(rows):
        columns = int(rng.choice([64, 128, 192, 256, 320, 384, 512, 768, 1024, 1408, 2048]))
        e = random_row(rng, columns, spread=20.0 if row % 2 else 0.0)
        want = lane_walk(e)
        walks = [("tile", tile_walk(e))]
        if columns % 128 == 0:
            walks.append(("fp8", fp8_walk(e)))
        found += [(name, columns) for name, got in walks if got.tobytes() != want.tobytes()]
    return found


if __name__ == "__main__":
    bad = mismatches()
    for name, columns in bad[:10]:
        print(f"{name} walk differs from the lane walk at {columns} columns")
    print(f"{len(bad)} mismatches")
    sys.exit(1 if bad else 0)
