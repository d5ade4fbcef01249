// The row-tile GEMMs' operand loads replayed without their math (`mok walk-bench`; issue 16).
// The row-tile GEMMs are bound by the fabric between the L2's two partitions (docs/perf.md,
// sessions 17-18), and the sectors that cross it depend on which CTAs read a line close together
// in time, not on a tile's bytes per FLOP alone: the 256 x 192 tiles ask for 10-14% fewer bytes
// than the 128 x 256 ones at dsv3_e128 and move 12-30% more through the fabric. A walk here is a
// GEMM's sequence of units (tile shape, grouping, order) over a shape's real row tiles; the
// replay issues each unit's TMA boxes of A and B per K-block into a three-stage ring, the
// consumer holding each stage as long as the unit's wgmmas would, so ncu can count each walk's
// fabric sectors and the walks can be compared without writing a GEMM for each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/shape.h"
#include "mok/testing/routing.h"

namespace mok {

// The forward's two row-tile GEMMs: gate/up (A = the expert rows [R, H], B = 96..128 gate and
// as many up rows of [E, I, H] per column tile, K = H) and down (A = h [R, I], B = rows of
// Wd [E, H, I], K = I).
enum class WalkForm { kGateUp, kDown };

struct WalkSpec {
  std::string name;
  int32_t tile_rows;       // 128: one schedule tile per unit; 256: an expert's tiles in pairs
  int32_t tile_n;          // output columns of B per unit (gate/up: half gate, half up)
  int32_t group;           // units grouped `group` row units at a time, swept n-major (1: n-major)
  bool lone_last = false;  // tile_rows 256: the experts' odd last tiles after every pair
};

// One unit of a walk: A rows [a_row, a_row + 128 * a_boxes), B columns [n0, n0 + tile_n) of
// `expert` (gate/up: n0 in [0, I), the gate and the up rows both). a_boxes = 0: no unit (a
// slot's padding in place_by_expert_halves), skipped by the replay and the byte counts.
struct WalkLoad {
  int32_t a_row;
  int32_t a_boxes;
  int32_t expert;
  int32_t n0;
};

// The units of `spec` for `form`, in walk order (CTA b of a grid of G takes units b, b + G, ...,
// as the expert GEMM kernels do). `tiles_per_expert`: the schedule's 128-row tiles of each
// expert, whose segments follow each other. `n_extent`: I for gate/up, H for down. With
// tile_rows 128 and group 8 this is expert_gemm.cu's walk (tile_walk.h); with tile_rows 256 and
// group 8 wide_tile_gemm.cu's (wide_tile_walk.h). Throws mok::Error on a spec it cannot walk.
std::vector<WalkLoad> plan_walk(const WalkSpec& spec, WalkForm form,
                                const std::vector<int32_t>& tiles_per_expert, int64_t n_extent);

// The walk's units laid out so that the CTA in slot s (of `grid`), taking positions s, s + grid,
// ..., runs only the units of one half of the experts: slots below `lower_slots` (default
// grid / 2) the first experts, in the same proportion of num_experts, the others the rest
// (`parity`: even slots the first half, odd slots the second), each half's units in the walk's
// order. Shorter halves are padded with no-units. With slots by SM (its rank, or its L2
// partition first), that keeps every line of an expert's rows and weights on the SMs of one
// half: if those halves are the L2's two partitions, no line is read from both.
std::vector<WalkLoad> place_by_expert_halves(const std::vector<WalkLoad>& loads,
                                             int32_t num_experts, int32_t grid, bool parity,
                                             int32_t lower_slots = -1);

// 128-row tiles of each expert for `routing` on one rank of `shape` (the layer's schedule:
// each expert's routed rows rounded up to 128).
std::vector<int32_t> walk_tiles_per_expert(const MoeShape& shape, RoutingKind routing,
                                           uint64_t seed);

// The bytes the walk's TMA boxes ask for (every box in full, as TMA counts them, less the rows
// of B past n_extent, which it zero-fills without reading).
int64_t walk_asked_bytes(const WalkSpec& spec, WalkForm form, const std::vector<WalkLoad>& loads,
                         int64_t n_extent, int64_t k);

// The bytes of the distinct boxes each wave of `grid` consecutive units asks for (an A row
// box of 128 rows, or a unit's B rows of one expert, counted once per wave however many of the
// wave's units load it), summed over the waves: the walk's bytes if every line read by CTAs
// running together crossed to them once. Session 18's fabric sectors were ~1.1-1.3x this for
// both kernels' walks at dsv3_e128 (docs/perf.md): the model walk-bench tests across walks.
int64_t walk_wave_unique_bytes(const WalkSpec& spec, WalkForm form,
                               const std::vector<WalkLoad>& loads, int64_t n_extent, int64_t k,
                               int32_t grid);

// Replays every walk of the built-in list for both forms on `shape`'s local experts, prints
// ms, the bytes asked and their rate (median of 5 runs) and returns 0. Needs a GPU.
struct WalkBenchOptions {
  bool once = false;  // one run of each walk, no warm-up (for ncu)
  // Only the expert GEMM's walk, its math modelled at 0..1536 SM cycles per 128 x 256 K-block
  // on three and on four stages, then with only its A or only its B boxes, on half and a quarter
  // of the SMs, with no loads, with one stage held or none instead of the GEMMs' two, and on one
  // CTA; each with block 0's cycles per K-block, SM clock, and its waits: what a K-block costs
  // when the loads are late, which operand holds them back, and whether contention does.
  bool pace_sweep = false;
  // Instead of the walks, the fabric probe: one L2 partition's SMs, then the other's, then every
  // SM, read an 8 MB buffer from L2 (for ncu's fabric sectors: whether a partition keeps copies
  // of the lines it reads from the other). Throws Error(kUnsupported) where the L2 probe finds
  // no clear partitions.
  bool fabric_probe = false;
};
int run_walk_bench(const MoeShape& shape, RoutingKind routing, uint64_t seed,
                   const WalkBenchOptions& options = {});

}  // namespace mok
