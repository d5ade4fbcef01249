#!/usr/bin/env python3
"""An L2 model of the row-tile GEMMs' walk: how many bytes come from HBM for a walk order.

The persistent kernel's CTAs take tiles c, c + grid, ... of the walk (fp8_gemm.cu,
expert_gemm.cu, tile_walk.h); each K-block of a tile loads a 16 KB block of A (its row tile) and
one of B (its expert's column tile; two in bf16's 256-column tiles). The model replays those
loads in time order through an LRU cache of L2's size, at 16 KB granularity, with every CTA at
one speed (in step) or at speeds spread by +-`--spread` (the drift of docs/perf.md, sessions 22
and 34), and counts the misses: the DRAM bytes read.

Walks: `fixed` groups of G row tiles (MoeConfig::gemm_tile_group), `aligned` groups of G moved
to expert starts within 4 tiles (gemm_expert_aligned_groups), `expert` groups of one expert's
tiles, at most G (gemm_expert_groups). Session 34's numbers at
`dsv3_local` (the defaults): the FP8 gate/up reads 2.22 GB in step and 3.65 GB at +-2% with
fixed groups of 8 (ncu measured ~2.85 GB read), 1.20 and 2.06 GB with expert groups of at most
16.

    python3 scripts/walk_l2_model.py --form gate_up --walks fixed:8,aligned:8,expert:16

The FP8 192-row tiles (fp8_gemm_192_rows.cu): `--chunks 3,2` gives each expert's tiles as
counts of 64-row chunks (`dsv3_e128`'s experts of 257-320 routed rows in the counted walk; `3,3`
padded; `2,2/3,3` draws one of the two per expert), A's block of a tile then 8 KB a chunk and
its K-block's time (8 KB a chunk + 16 KB of B) / 40 KB, as if bound by its bytes. `--by-ticket`
takes the tiles from one launch-wide counter (Fp8GemmParams::tile_tickets) instead of CTA c's
c, c + grid, ... (session 51: in the static walk at `3,2` CTA c always takes tiles of c's
parity; the model: 3.73 GB from HBM against 1.96 by ticket, and 10% longer).

    python3 scripts/walk_l2_model.py --form down --experts 128 --chunks 3,2 --walks fixed:8

`--pairs` (the gate/up with SwiGLU in its epilogue, Fp8GemmParams::swiglu_h_codes): the walk's
units are (g, u) column pairs, a CTA computing a unit's g tile and then its u tile. Session 66
at `dsv3_local` (`--chunks 3,3,3,3,3,1 --by-ticket --l2-mb 25`: each half of the H100's L2
keeps its own copy of the lines both halves read): the walk by tiles 1.88 GB, the (g, u) units
3.16 GB, against ncu's 2.24 and 3.36.
"""

import argparse
import bisect
import heapq
import random
from collections import OrderedDict

BLOCK_BYTES = 16384  # one 128 x 128 e4m3 block, or 128 x 64 bf16
CHUNK_BYTES = 8192  # a 64-row chunk of a 192-row tile's A block
# dsv3_local's row-tile GEMMs: (column tiles, K-blocks per tile, 16 KB blocks of B per K-block).
# FP8: 128 x 128 tiles, K-blocks of 128. bf16: 128 x 256 tiles (gate/up: 128 gate + 128 up
# columns), K-blocks of 64.
FORMS = {
    "fp8": {
        "gate_up": (32, 56, 1),
        "down": (56, 16, 1),
        "down_dgrad": (16, 56, 1),
        "gate_up_dgrad": (56, 32, 1),
    },
    "bf16": {
        "gate_up": (16, 112, 2),
        "down": (28, 32, 2),
        "down_dgrad": (8, 112, 2),
        "gate_up_dgrad": (28, 64, 2),
    },
}


def group_starts(walk, group, tiles_per_expert):
    """The first row tile of every group, and the row tiles' experts."""
    tile_expert = [e for e, count in enumerate(tiles_per_expert) for _ in range(count)]
    m_tiles = len(tile_expert)
    if walk == "fixed":
        starts = list(range(0, m_tiles, group))
    elif walk == "aligned":
        starts = [0]
        for nominal in range(group, m_tiles, group):
            start = nominal
            for i in range(min(4, group - 1)):
                if nominal + i >= m_tiles:  # the end counts as an expert start
                    start = m_tiles
                    break
                if tile_expert[nominal + i] != tile_expert[nominal + i - 1]:
                    start = nominal + i
                    break
            starts.append(start)
    elif walk == "expert":
        starts, first = [], 0
        for count in tiles_per_expert:
            groups = -(-count // group)
            for g in range(groups):
                starts.append(first + g * (count // groups) + min(g, count % groups))
            first += count
    else:
        raise ValueError(f"walk {walk!r}; valid: fixed, aligned, expert")
    return sorted(set(starts)) + [m_tiles], tile_expert


def dram_bytes(
    walk,
    group,
    tiles_per_expert,
    form,
    l2_mb,
    ctas,
    spread,
    seed,
    chunks=None,
    by_ticket=False,
    pairs=False,
):
    """GB read from HBM, and the walk's time in K-blocks of a full tile (the last CTA's end).

    chunks: each row tile's 64-row chunks (192-row tiles), or None (128-row tiles).
    pairs: the gate/up GEMM with SwiGLU in its epilogue (Fp8GemmParams::swiglu_h_codes): the
    walk's units are (g, u) column pairs over half the column tiles; a CTA takes a unit (static
    or by ticket) and computes its g tile, then its u tile (the same columns of the other half)."""
    n_tiles, k_blocks, b_blocks = form
    starts, tile_expert = group_starts(walk, group, tiles_per_expert)
    m_tiles = len(tile_expert)
    walk_n = n_tiles // 2 if pairs else n_tiles
    per_unit = 2 if pairs else 1
    num_tiles = m_tiles * n_tiles
    capacity = l2_mb * 2**20
    cache, cached, missed = OrderedDict(), 0, 0
    rng = random.Random(seed)
    speed = [1.0 + spread * rng.uniform(-1, 1) for _ in range(ctas)]
    first_tiles = min(ctas, num_tiles // per_unit)
    events = [(0.0, c, c * per_unit, 0) for c in range(first_tiles)]
    heapq.heapify(events)
    next_ticket, end = first_tiles, 0.0
    while events:
        time, cta, tile, k = heapq.heappop(events)
        unit, half = divmod(tile, per_unit)
        row = unit // walk_n
        g = bisect.bisect_right(starts, row) - 1
        first, group_m = starts[g], starts[g + 1] - starts[g]
        in_group = unit - first * walk_n
        m, n = first + in_group % group_m, in_group // group_m + half * walk_n
        a_bytes = BLOCK_BYTES if chunks is None else chunks[m] * CHUNK_BYTES
        blocks = [(("a", m, k), a_bytes)]
        blocks += [(("b", tile_expert[m], n, k, j), BLOCK_BYTES) for j in range(b_blocks)]
        for block, size in blocks:
            if block in cache:
                cache.move_to_end(block)
                continue
            missed += size
            cache[block] = size
            cached += size
            while cached > capacity:
                cached -= cache.popitem(last=False)[1]
        step = 1.0 if chunks is None else (a_bytes + BLOCK_BYTES) / (3 * CHUNK_BYTES + BLOCK_BYTES)
        k += 1
        if k == k_blocks:
            k = 0
            if pairs and half == 0:
                tile += 1  # the unit's u tile
            elif by_ticket:
                tile, next_ticket = next_ticket * per_unit, next_ticket + 1
            else:
                tile = (tile // per_unit + ctas) * per_unit
            if tile >= num_tiles:
                end = max(end, time + step * speed[cta])
                continue
        heapq.heappush(events, (time + step * speed[cta], cta, tile, k))
    return missed / 1e9, end


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=sorted(FORMS), default="fp8")
    parser.add_argument("--form", choices=sorted(FORMS["fp8"]), default="gate_up")
    parser.add_argument("--walks", default="fixed:8,aligned:8,expert:16")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tiles", default="9", help="row tiles per expert: N, or LO-HI at random")
    parser.add_argument("--l2-mb", type=float, default=40.0)
    parser.add_argument("--ctas", type=int, default=132)
    parser.add_argument("--spread", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--chunks",
        help="192-row tiles: each expert's tiles' 64-row chunks, e.g. 3,2; several patterns "
        "separated by / are drawn at random per expert, e.g. 2,2/3,3",
    )
    parser.add_argument("--by-ticket", action="store_true")
    parser.add_argument(
        "--pairs", action="store_true", help="gate/up: (g, u) units (SwiGLU epilogue)"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    chunks = None
    if args.chunks:  # patterns separated by '/' are drawn at random per expert
        patterns = [[int(v) for v in p.split(",")] for p in args.chunks.split("/")]
        drawn = [rng.choice(patterns) for _ in range(args.experts)]
        tiles_per_expert = [len(pattern) for pattern in drawn]
        chunks = [c for pattern in drawn for c in pattern]
    elif "-" in args.tiles:
        lo, hi = (int(v) for v in args.tiles.split("-"))
        tiles_per_expert = [rng.randint(lo, hi) for _ in range(args.experts)]
    else:
        tiles_per_expert = [int(args.tiles)] * args.experts
    form = FORMS[args.precision][args.form]
    order = "by ticket" if args.by_ticket else "static"
    if args.pairs:
        order += ", (g, u) units"
    for spec in args.walks.split(","):
        walk, group = spec.split(":")
        (in_step, in_step_end), (spread, spread_end) = (
            dram_bytes(
                walk,
                int(group),
                tiles_per_expert,
                form,
                args.l2_mb,
                args.ctas,
                s,
                args.seed,
                chunks,
                args.by_ticket,
                args.pairs,
            )
            for s in (0.0, args.spread)
        )
        print(
            f"{args.precision} {args.form} {walk} groups of {group}, {order}: {in_step:.2f} GB from "
            f"HBM in step (ends at {in_step_end:.0f} K-blocks), {spread:.2f} GB at "
            f"+-{args.spread:.0%} CTA speeds (ends at {spread_end:.0f})"
        )


if __name__ == "__main__":
    main()
