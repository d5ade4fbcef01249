// The walk replay behind `mok walk-bench` (mok/testing/walk_bench.h).
//
// Kernel map: one CTA per SM (its dynamic shared memory is sized so no second CTA fits), two
// warps, as a GEMM's producer and consumers. Lane 0 of warp 0 is the producer: for each of its
// units (b, b + grid, ... of the plan) and each K-block of 64, it waits for a free stage of a
// three-stage ring (four with --pace-sweep's deeper runs), arms the stage's full mbarrier with the
// bytes its boxes bring, and issues them: one or two [128 x 64] boxes of A, then B (gate/up: tile_n
// / 2 gate and tile_n / 2 up rows of [E, I, H], one box each; down: one box of tile_n rows of Wd
// [E, H, I]). Warp 1 is the consumer, a model of the GEMMs' tensor pipe: each K-block's math
// takes the unit's hold (kCyclesPer128x256 per K-block of a 128 x 256 tile, in proportion to the
// unit's rows x columns) and starts when the previous one ends or when its stage lands, if later.
// Its times are deadlines on clock64, so the loop's own instructions add nothing while the
// loads keep up: session 20's delay loop added ~500 cycles per K-block whatever was loaded
// (session 21: as much with no loads at all). As the GEMMs' consumers do (wgmma wait_group 1), it
// holds two stages, the running K-block's and the queued one's, and releases each on its empty
// mbarrier when its math ends (--pace-sweep also runs one stage held, and none). The drift walks
// give each CTA a math speed of its own (+-5%) and, kept in step, run the GEMMs' lockstep
// (kernels/gemm/lockstep.h) in the producer. Nothing else runs: the time and ncu's sectors are
// the walk's loads alone.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/lockstep.h"
#include "kernels/stages/launch.h"
#include "layer/cuda_buffer.h"
#include "layer/l2_partitions.h"
#include "layer/tma.h"
#include "mok/error.h"
#include "mok/testing/walk_bench.h"
#include "testing/bench_device.h"

namespace mok {

namespace {

constexpr int32_t kBoxK = 64;     // the GEMMs' K-block
constexpr int32_t kRowBox = 128;  // rows of one A box
// The ring's memory: three stages of two A boxes and 256 rows of B (what a 256-row unit loads).
// A walk's stage holds its unit's A boxes and B of K-block box_k (stage_bytes), so 128-row units
// fit four stages of 48 KB (the expert GEMM's), or with K-blocks of 32 six of 24 KB. (Eight of
// 24 KB, the ring's bytes exactly, ended in an illegal address on the H200, session 22: not yet
// understood, so not run.)
constexpr int32_t kStages = 3;
constexpr int32_t kRingBytes = kStages * (2 * 16384 + 32768);
constexpr int32_t kMaxStages = 6;
constexpr int32_t kDeepStages = 4;  // the most 48 KB stages the ring holds
constexpr int32_t kSharedBytes = kRingBytes + 1024;
// The stage of a unit of `tile_rows` rows and K-blocks of box_k: its A boxes, then 256 rows of B.
constexpr int32_t stage_bytes_of(int32_t tile_rows, int32_t box_k) {
  return (tile_rows / kRowBox) * kRowBox * box_k * 2 + 256 * box_k * 2;
}
// SM cycles of one 128 x 256 x 64 K-block (4.19 MFLOP) at ~650 TFLOP/s over 132 SMs and ~1.75
// GHz, as the stream bench paces it.
constexpr int32_t kCyclesPer128x256 = 1500;
// A tile's epilogue (~1.5 us at 1.98 GHz): the gate/up GEMM's staging, SwiGLU and stores of a
// 128 x 256 tile between two mainloops.
constexpr int32_t kEpilogueCycles = 3000;

struct WalkParams {
  CUtensorMap a_map;   // [rows, K], box [128, 64]
  CUtensorMap b_map0;  // gate/up: the gate rows [E, I, H]; down: Wd [E, H, I]; box [b_box, 64]
  CUtensorMap b_map1;  // gate/up: the up rows
  const int4* units;   // WalkLoad {a_row, a_boxes, expert, n0}
  int32_t num_units;
  int32_t k_blocks;
  int32_t gate_up;
  int32_t b_rows;  // B rows a unit loads per map (gate/up: tile_n / 2; down: tile_n)
  int32_t b_box;   // rows of one B box
  int32_t n_extent;
  int32_t cycles_per_a_box;  // pacing per 128 rows of A per K-block (0: unpaced)
  const int32_t* sm_slot;    // non-null: CTA on SM s takes the units of slot sm_slot[s]
  // Non-null: block 0 writes its ProbeSlot entries (the SM clock, the cycles per K-block, and
  // where they go: the consumer's waits for a loaded stage, the producer's for a free one).
  long long* clock_probe;
  int32_t operands;     // which boxes a stage loads: kLoadA | kLoadB (--pace-sweep's splits)
  int32_t stages;       // ring depth, at most kMaxStages
  int32_t stage_bytes;  // stage_bytes_of(the walk's tile rows, box_k); stages of it fit the ring
  int32_t box_k;        // K of a stage's boxes: kBoxK as the GEMMs, or 32 (finer stages)
  // SM cycles the consumer spends after each unit's last K-block before the next unit's math
  // (a GEMM tile's epilogue), its stages released (wgmma wait_group 0, as the GEMMs end a tile).
  int32_t epilogue_cycles;
  // Stages the consumer holds while the modeled tensor pipe runs (the kernel map above): 2 as
  // the GEMMs' consumers do, 1, or 0 (each stage released as soon as it lands).
  int32_t held_stages;
  // Each CTA's math runs this many percent slower or faster than the hold, by block (spread
  // evenly over [-speed_spread_pct, +speed_spread_pct]): the GEMMs' CTAs do not run alike (SM
  // clocks, near and far L2 lines), and the drift test needs them not to.
  int32_t speed_spread_pct;
  // MoeConfig::gemm_lockstep_k_blocks in the replay: the producers kept in step (ticks null: off;
  // max_units: the most non-padding units any CTA walks).
  kernels::GemmLockstep lockstep;
  int32_t max_units;
  kernels::WaitContext wait;
};

// Block b's math speed: its hold scaled by (100 + spread) / 100, spread in
// [-speed_spread_pct, speed_spread_pct] by a hash of b (0 without a spread).
__device__ __forceinline__ int32_t hold_of(const WalkParams& p, int32_t hold) {
  if (p.speed_spread_pct == 0) return hold;
  const uint32_t mixed = (blockIdx.x * 2654435761u) >> 16;
  const int32_t spread =
      (static_cast<int32_t>(mixed % 201u) - 100) * p.speed_spread_pct / 100;  // percent
  return hold * (100 + spread) / 100;
}

__device__ __forceinline__ int32_t sm_id() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return static_cast<int32_t>(sm);
}

// The CTA's slot in the walk: its block index, or its SM's rank among the SMs' ids.
__device__ __forceinline__ int32_t walk_slot(const WalkParams& p) {
  return p.sm_slot != nullptr ? p.sm_slot[sm_id()] : static_cast<int32_t>(blockIdx.x);
}

constexpr int32_t kLoadA = 1, kLoadB = 2;

// Block 0's clock probe (WalkParams::clock_probe), in SM cycles where not said.
enum ProbeSlot : int {
  kProbeStartClock,    // the consumer's clock64 at its first wait
  kProbeStartNs,       // and %globaltimer
  kProbeEndClock,      // after its last release
  kProbeEndNs,         //
  kProbeKBlocks,       // stages consumed
  kProbeConsumerWait,  // cycles in the waits for a stage not yet landed when tested
  kProbeBlockedWaits,  // those waits
  kProbeIssueToReady,  // over those waits: from the producer's issue to the stage's landing
  kProbeProducerLead,  // over all waits: stages issued and not yet consumed, at the wait
  kProbeProducerWait,  // the producer's cycles in the waits for a free stage
  kProbeSlots
};

__device__ __forceinline__ uint32_t unit_bytes(const WalkParams& p, const int4& unit) {
  const int32_t b_rows = min(p.b_rows, p.n_extent - unit.w);
  const int32_t b_loaded = ((b_rows + p.b_box - 1) / p.b_box) * p.b_box;  // whole boxes
  return ((p.operands & kLoadA) ? unit.y * kRowBox * p.box_k * 2 : 0) +
         ((p.operands & kLoadB) ? (p.gate_up ? 2 : 1) * b_loaded * p.box_k * 2 : 0);
}

__global__ void __launch_bounds__(64, 1) walk_replay_kernel(const __grid_constant__ WalkParams p) {
  extern __shared__ unsigned char dynamic_smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ uint64_t empty[kMaxStages];
  // Block 0's probes: when the producer issued each stage, and how many it has issued.
  __shared__ volatile long long issue_clock[kMaxStages];
  __shared__ volatile long long issued;
  unsigned char* ring = &ptx::align_shared_1024<unsigned char>(dynamic_smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&p.a_map);
    ptx::prefetch_tensor_map(&p.b_map0);
    for (int s = 0; s < p.stages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], 1);
    }
    ptx::fence_barrier_init();
    issued = 0;
  }
  __syncthreads();
  const int32_t slot0 = walk_slot(p);
  if (slot0 < 0) return;  // an SM the id table lacks (run_walk_bench checks the set first)
  int64_t g = 0;          // stages issued (producer) or consumed (consumer)
  const int32_t stage_bytes = p.stage_bytes;
  const bool probed_block = p.clock_probe != nullptr && blockIdx.x == 0;
  if (warp == 0) {
    if (lane != 0) return;
    long long producer_wait = 0;
    const bool lockstep = p.lockstep.ticks != nullptr && p.max_units > 0;
    kernels::LockstepCta step;
    int32_t local_unit = 0;
    for (int32_t u = slot0; u < p.num_units; u += gridDim.x) {
      const int4 unit = p.units[u];
      if (unit.y == 0) continue;  // a slot's padding
      if (lockstep && local_unit == 0)
        step = kernels::lockstep_begin(
            p.lockstep, kernels::lockstep_plan(p.lockstep.lead_k_blocks, p.k_blocks, p.max_units));
      const uint32_t bytes = unit_bytes(p, unit);
      for (int32_t kb = 0; kb < p.k_blocks; ++kb, ++g) {
        if (lockstep) kernels::lockstep_k_block(p.lockstep, step, p.wait, local_unit, kb);
        const int slot = static_cast<int>(g % p.stages);
        const long long wait_start = clock64();
        if (g >= p.stages)
          kernels::mbarrier_wait(p.wait, kernels::WaitSite::kGemmFreeStage, &empty[slot],
                                 static_cast<uint32_t>((g / p.stages - 1) & 1));
        if (probed_block) {
          const long long now = clock64();
          producer_wait += now - wait_start;
          issue_clock[slot] = now;
          issued = g + 1;
        }
        unsigned char* stage = ring + slot * stage_bytes;
        ptx::mbarrier_arrive_expect_tx(&full[slot], bytes);
        const int32_t k = kb * p.box_k;
        for (int32_t box = 0; box < ((p.operands & kLoadA) ? unit.y : 0); ++box)
          ptx::tma_load_2d(stage + box * kRowBox * p.box_k * 2, &p.a_map, &full[slot], k,
                           unit.x + box * kRowBox);
        unsigned char* b = stage + stage_bytes - 256 * p.box_k * 2;  // after the A boxes
        const int32_t b_rows = (p.operands & kLoadB) ? min(p.b_rows, p.n_extent - unit.w) : 0;
        for (int32_t map = 0; map < (p.gate_up ? 2 : 1); ++map)
          for (int32_t r = 0; r < b_rows; r += p.b_box) {
            ptx::tma_load_3d(b, map == 0 ? &p.b_map0 : &p.b_map1, &full[slot], k, unit.w + r,
                             unit.z);
            b += p.b_box * p.box_k * 2;
          }
      }
      ++local_unit;
    }
    if (lockstep) kernels::lockstep_end(p.lockstep, step, local_unit);
    if (probed_block) p.clock_probe[kProbeProducerWait] = producer_wait;
    return;
  }
  const bool probes = probed_block && lane == 0;
  long long start_clock = 0, consumer_wait = 0, blocked = 0, issue_to_ready = 0, lead = 0;
  if (probes) {
    start_clock = clock64();
    p.clock_probe[kProbeStartNs] = static_cast<long long>(ptx::globaltimer_ns());
  }
  // The modeled tensor pipe: K-block g's math starts when the previous one's ends, or when its
  // stage lands if that is later, and takes `hold` cycles. The times are deadlines, not
  // delays, so the loop's own instructions cost nothing while the loads keep up.
  long long pipe_free = 0;  // when the math issued so far ends
  long long previous_end = 0;
  int previous_slot = -1;  // held_stages 2: the stage whose math is still running
  // Hands stage `slot` back once the modeled math that reads it ends at `end`.
  const auto release_at = [&](int slot, long long end) {
    while (clock64() < end) {
    }
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&empty[slot]);
  };
  for (int32_t u = slot0; u < p.num_units; u += gridDim.x) {
    if (p.units[u].y == 0) continue;
    const int32_t hold = hold_of(p, p.cycles_per_a_box * p.units[u].y);
    for (int32_t kb = 0; kb < p.k_blocks; ++kb, ++g) {
      const int slot = static_cast<int>(g % p.stages);
      const uint32_t parity = static_cast<uint32_t>((g / p.stages) & 1);
      if (probes) lead += issued - g;
      long long start = pipe_free;
      if (!ptx::mbarrier_test_wait(&full[slot], parity)) {
        const long long wait_start = clock64();
        kernels::mbarrier_wait(p.wait, kernels::WaitSite::kGemmLoadedStage, &full[slot], parity);
        const long long landed = clock64();
        start = max(start, landed);
        if (probes) {
          consumer_wait += landed - wait_start;
          ++blocked;
          issue_to_ready += landed - issue_clock[slot];
        }
      }
      if (pipe_free == 0) start = clock64();  // the first K-block
      pipe_free = start + hold;
      if (p.held_stages == 0) {
        release_at(slot, 0);
      } else if (p.held_stages == 1) {
        release_at(slot, pipe_free);
      } else {
        // As the GEMMs' consumers: this K-block's math queued behind the previous one, whose
        // stage is released when it ends (wgmma wait_group 1).
        if (previous_slot >= 0) release_at(previous_slot, previous_end);
        previous_slot = slot;
        previous_end = pipe_free;
      }
    }
    // A tile's end as the GEMMs' consumers make it: its last stage released once its math ends
    // (wait_group 0), then the epilogue before the next tile's math can start.
    if (p.epilogue_cycles > 0) {
      if (previous_slot >= 0) release_at(previous_slot, pipe_free);
      while (clock64() < pipe_free) {
      }
      previous_slot = -1;
      pipe_free = clock64() + p.epilogue_cycles;
    }
  }
  if (previous_slot >= 0) release_at(previous_slot, pipe_free);
  while (clock64() < pipe_free) {
  }
  if (probes) {
    p.clock_probe[kProbeStartClock] = start_clock;
    p.clock_probe[kProbeEndClock] = clock64();
    p.clock_probe[kProbeEndNs] = static_cast<long long>(ptx::globaltimer_ns());
    p.clock_probe[kProbeKBlocks] = g;
    p.clock_probe[kProbeConsumerWait] = consumer_wait;
    p.clock_probe[kProbeBlockedWaits] = blocked;
    p.clock_probe[kProbeIssueToReady] = issue_to_ready;
    p.clock_probe[kProbeProducerLead] = lead;
  }
}

// Where a walk's units run. The expert GEMMs give CTA b the units b, b + grid, ... (kBlock).
// The SM-id placements give them to the CTA on the SM of rank b among the SMs' ids instead:
// kSmAdjacent keeps the walk's order, so consecutive units (an expert's row tiles on one weight
// tile) run on SMs of neighbouring ids, which share a TPC and a GPC and so one L2 partition
// if the ids follow the chip's layout; kSmSplit moves every odd unit of each wave to the other
// half of the ids, so those neighbours run apart. If the fabric's sectors follow which SMs read
// a line together, the three differ.
// kSmHalves and kSmParity give each half of the SM ranks (the lower and upper halves, or the
// even and odd ranks) the units of one half of the experts (place_by_expert_halves): if those
// halves are the L2's partitions, no line is read from both.
// kL2Partition does the same with the L2 partitions that probe_l2_partitions finds from load
// latencies: each partition's SMs run the units of their share of the experts.
enum class Placement { kBlock, kSmAdjacent, kSmSplit, kSmHalves, kSmParity, kL2Partition };

struct WalkCase {
  WalkSpec spec;
  bool paced;
  Placement placement = Placement::kBlock;
  int32_t stages = kStages;      // the ring (WalkParams)
  int32_t box_k = kBoxK;         // K of a stage
  int32_t epilogue_cycles = 0;   // per unit
  int32_t speed_spread_pct = 0;  // WalkParams::speed_spread_pct
  int32_t lockstep_lead = 0;     // K-blocks (WalkParams::lockstep; 0: off)
};

// The expert GEMM's walk and the 256 x 192 tiles' (both paced, as their math holds the ring,
// and unpaced), then variants of the grouping and of the tile.
const WalkCase kWalks[] = {
    {{"128 x 256, groups of 8 (expert GEMM)", 128, 256, 8}, true},
    // The ring: four stages (two loading while two are held), K-blocks of 32 in six stages (the
    // same bytes loading in finer stages), and each tile followed by an epilogue of ~1.5 us
    // (kEpilogueCycles) on three and four stages: whether the pauses make the CTAs that share a
    // weight tile drift apart and read it from DRAM again (ncu's DRAM bytes, --once).
    {{"128 x 256, 4 stages", 128, 256, 8}, true, Placement::kBlock, kDeepStages},
    {{"128 x 256, K-blocks of 32, 6 stages", 128, 256, 8}, true, Placement::kBlock, 6, 32},
    {{"128 x 256, epilogues", 128, 256, 8},
     true,
     Placement::kBlock,
     kStages,
     kBoxK,
     kEpilogueCycles},
    {{"128 x 256, epilogues, 4 stages", 128, 256, 8},
     true,
     Placement::kBlock,
     kDeepStages,
     kBoxK,
     kEpilogueCycles},
    // The drift test with CTAs of unequal speeds (+-5%: WalkParams::speed_spread_pct), on three
    // and four stages, with epilogues, free-running and kept in step within 16 K-blocks
    // (lockstep.h): whether the fourth stage loses the CTAs' L2 sharing as the GEMMs' does
    // (docs/perf.md, session 22: 22 GB of DRAM against 11), and whether the lockstep keeps it.
    {{"128 x 256, epilogues, speeds +-5%", 128, 256, 8},
     true,
     Placement::kBlock,
     kStages,
     kBoxK,
     kEpilogueCycles,
     5},
    {{"128 x 256, epilogues, 4 stages, speeds +-5%", 128, 256, 8},
     true,
     Placement::kBlock,
     kDeepStages,
     kBoxK,
     kEpilogueCycles,
     5},
    {{"128 x 256, epilogues, 4 stages, speeds +-5%, in step", 128, 256, 8},
     true,
     Placement::kBlock,
     kDeepStages,
     kBoxK,
     kEpilogueCycles,
     5,
     16},
    {{"256 x 192, groups of 8 (256 x 192 tiles)", 256, 192, 8}, true},
    {{"256 x 192, in step", 256, 192, 8}, true, Placement::kBlock, kStages, kBoxK, 0, 0, 16},
    {{"128 x 256, groups of 8, unpaced", 128, 256, 8}, false},
    {{"256 x 192, groups of 8, unpaced", 256, 192, 8}, false},
    {{"128 x 256, groups of 2", 128, 256, 2}, true},
    {{"128 x 256, groups of 32", 128, 256, 32}, true},
    {{"128 x 256, n-major (groups of 1)", 128, 256, 1}, true},
    {{"256 x 192, groups of 2", 256, 192, 2}, true},
    {{"256 x 192, groups of 32", 256, 192, 32}, true},
    {{"128 x 192, groups of 8", 128, 192, 8}, true},
    {{"256 x 256, groups of 8 (bytes only)", 256, 256, 8}, true},
    {{"256 x 192, groups of 8, lone tiles last", 256, 192, 8, true}, true},
    {{"128 x 256, groups of 8, by SM id", 128, 256, 8}, true, Placement::kSmAdjacent},
    {{"128 x 256, groups of 8, by SM id, split", 128, 256, 8}, true, Placement::kSmSplit},
    {{"256 x 192, groups of 8, by SM id", 256, 192, 8}, true, Placement::kSmAdjacent},
    {{"256 x 192, groups of 8, by SM id, split", 256, 192, 8}, true, Placement::kSmSplit},
    {{"128 x 256, experts by SM-id halves", 128, 256, 8}, true, Placement::kSmHalves},
    {{"128 x 256, experts by SM-id parity", 128, 256, 8}, true, Placement::kSmParity},
    {{"256 x 192, experts by SM-id halves", 256, 192, 8}, true, Placement::kSmHalves},
    {{"256 x 192, experts by SM-id parity", 256, 192, 8}, true, Placement::kSmParity},
    {{"128 x 256, experts by L2 partition", 128, 256, 8}, true, Placement::kL2Partition},
    {{"256 x 192, experts by L2 partition", 256, 192, 8}, true, Placement::kL2Partition},
    {{"128 x 256, experts by L2 partition, unpaced", 128, 256, 8}, false, Placement::kL2Partition},
};

// `--pace-sweep`: the expert GEMM's walk with each stage held this many SM cycles per 128 x 256
// K-block (0: unpaced). A 128 x 256 x 64 K-block's eight m64n256k16 wgmmas keep the tensor
// pipe busy 1024 cycles at its dense rate, so a walk whose loads keep up at a hold of 1024 would
// let the GEMM run at the pipe's rate; where a hold's time exceeds hold x K-blocks, the loads
// set it.
// Each hold runs on the GEMM's three stages and on four (kDeepStages): whether more bytes in
// flight shorten a K-block. Then the three-stage ring at kCheckHolds with only the A boxes or
// only the B boxes loaded: which operand's loads carry the cycles a K-block takes over its hold.
const int32_t kPaceSweepHolds[] = {0, 768, 1024, 1152, 1280, 1408, 1536};
const int32_t kCheckHolds[] = {1024, 1536};
// And the whole walk on half and a quarter of the SMs (each CTA taking more units): if the
// extra cycles per K-block come from contention in the L2, the fabric or DRAM, they shrink with
// the load; if from each SM's own loads, they stay.
const int32_t kGridDivisors[] = {2, 4};

// A slot table (SM id -> slot) on the device.
std::unique_ptr<DeviceBuffer> upload_slots(const std::vector<int32_t>& slot_of_id,
                                           const char* what) {
  auto buffer = std::make_unique<DeviceBuffer>(
      static_cast<int64_t>(slot_of_id.size() * sizeof(int32_t)), what);
  cuda_check(cudaMemcpy(buffer->pointer, slot_of_id.data(), slot_of_id.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice),
             what);
  return buffer;
}

// kSmSplit's order: within each wave of `grid` units, unit 2j goes to slot j and unit 2j + 1
// to slot grid / 2 + j (an odd grid's last unit stays last).
std::vector<WalkLoad> split_waves(const std::vector<WalkLoad>& loads, int32_t grid) {
  std::vector<WalkLoad> out(loads);
  const int32_t half = grid / 2;
  for (size_t wave = 0; wave + grid <= loads.size(); wave += grid)
    for (int32_t j = 0; j < half; ++j) {
      out[wave + j] = loads[wave + 2 * j];
      out[wave + half + j] = loads[wave + 2 * j + 1];
    }
  return out;
}

std::string gb(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", value);
  return text;
}

class WalkRunner {
 public:
  WalkRunner() {
    num_sms_ = current_sm_count();
    cuda_check(cudaFuncSetAttribute(walk_replay_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kSharedBytes),
               "cudaFuncSetAttribute(walk_replay_kernel)");
  }
  // `grid` CTAs (0: one per SM).
  void launch(const WalkParams& p, int grid = 0) const {
    const int ctas = grid > 0 ? grid : num_sms_;
    walk_replay_kernel<<<ctas, 64, kSharedBytes>>>(p);
    cuda_check(cudaGetLastError(), "walk_replay_kernel launch");
  }
  int num_sms() const { return num_sms_; }

 private:
  int num_sms_ = 0;
};

// The fabric probe: does an L2 partition keep copies of the lines its SMs read from the other
// partition? The CTAs on the SMs of `reader` (0 or 1: that partition's slots; 2: every SM) each
// read the whole buffer once with L2-only loads (ld.global.cg, no L1), the others leave. (Read
// four times, the repeats folded into one: session 21's ncu counted one buffer per CTA.) With
// copies kept, the fabric carries each far-homed line once per reading partition (about half the
// buffer); without, once per read. ncu's fabric sectors of the three launches tell which.
__global__ void __launch_bounds__(1024, 1)
    fabric_probe_kernel(const uint4* buffer, int64_t vectors, const int32_t* slot_of_sm,
                        int32_t lower_slots, int32_t reader, unsigned int* sink) {
  const int32_t slot = slot_of_sm[sm_id()];
  if (reader < 2 && (slot < lower_slots ? 0 : 1) != reader) return;
  unsigned int folded = 0;
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    const uint4 v = __ldcg(buffer + i);
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (folded == 0x9e3779b9u) atomicAdd(sink, 1u);  // keeps the loads; almost never taken
}

// Runs the fabric probe's three launches (partition 0 reads, partition 1 reads, every SM reads)
// and prints their times. `slot_of_sm`: the layer's L2 slot table on the device.
void run_fabric_probe(const int32_t* slot_of_sm, int32_t lower_slots, int num_sms, bool once) {
  constexpr int64_t kBufferBytes = int64_t{8} << 20;  // fits the L2 many times over
  DeviceBuffer buffer(kBufferBytes, "fabric probe buffer");
  DeviceBuffer sink(sizeof(unsigned int), "fabric probe sink");
  cuda_check(cudaMemset(buffer.pointer, 0x5a, kBufferBytes), "fabric probe buffer fill");
  // More shared memory than two CTAs can share: one CTA per SM.
  constexpr int kProbeShared = 120 * 1024;
  cuda_check(cudaFuncSetAttribute(fabric_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kProbeShared),
             "cudaFuncSetAttribute(fabric_probe_kernel)");
  std::printf(
      "  fabric probe: each reading CTA reads %lld MB from L2 (ncu's fabric sectors:\n"
      "  about half the buffer per reading partition if a partition keeps copies of far lines,\n"
      "  about half of every read if not)\n",
      static_cast<long long>(kBufferBytes >> 20));
  const char* readers[] = {"partition 0's SMs", "partition 1's SMs", "every SM"};
  for (int32_t reader = 0; reader < 3; ++reader) {
    const double ms = median_event_ms(
        [&] {
          fabric_probe_kernel<<<num_sms, 1024, kProbeShared>>>(
              buffer.as<uint4>(), kBufferBytes / 16, slot_of_sm, lower_slots, reader,
              sink.as<unsigned int>());
          cuda_check(cudaGetLastError(), "fabric_probe_kernel launch");
        },
        once ? 1 : 5, once ? 0 : 1);
    std::printf("    %-18s read: %8.3f ms\n", readers[reader], ms);
  }
}

}  // namespace

int run_walk_bench(const MoeShape& shape, RoutingKind routing, uint64_t seed,
                   const WalkBenchOptions& options) {
  const bool once = options.once, pace_sweep = options.pace_sweep;
  const int64_t E = shape.num_local_experts(), H = shape.hidden, I = shape.intermediate;
  const std::vector<int32_t> tiles = walk_tiles_per_expert(shape, routing, seed);
  int64_t num_tiles = 0;
  for (const int32_t t : tiles) num_tiles += t;
  const int64_t rows = num_tiles * 128;
  WalkRunner runner;
  std::printf(
      "mok walk-bench: E=%lld H=%lld I=%lld, %s routing: %lld row tiles; %d CTAs, TMA "
      "loads only, %s\n",
      static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(I),
      routing_kind_name(routing), static_cast<long long>(num_tiles), runner.num_sms(),
      once ? "one run each (for ncu)" : "median of 5 runs");
  std::printf(
      "  asked: the bytes of the walk's boxes; wave: of the distinct boxes of each wave of "
      "%d units (walk_bench.h)\n",
      runner.num_sms());
  // The SMs and their L2 partitions, from the probe (one CTA per SM): slots by rank among the SM
  // ids for the SM-id placements, the layer's slot table for the L2-partition ones.
  const L2PartitionMap partitions = probe_l2_partitions(runner.num_sms());
  std::vector<int32_t> sms = partitions.sm_ids;
  std::sort(sms.begin(), sms.end());
  std::unique_ptr<DeviceBuffer> sm_slot, partition_slot;
  int32_t partition0_sms = 0;
  if (sms.front() < 0 || std::adjacent_find(sms.begin(), sms.end()) != sms.end()) {
    std::printf("  two CTAs shared an SM: the SM-id placements are skipped\n");
  } else {
    std::printf("  SM ids %d..%d (%zu SMs); %s\n", sms.front(), sms.back(), sms.size(),
                partitions.describe().c_str());
    std::vector<int32_t> rank_of_id(sms.back() + 1, -1);
    for (size_t r = 0; r < sms.size(); ++r) rank_of_id[sms[r]] = static_cast<int32_t>(r);
    sm_slot = upload_slots(rank_of_id, "walk-bench SM slots");
    const L2SlotTable table = l2_slot_table(partitions);  // the layer's (gemm_l2_placement)
    if (!table.slot_of_sm.empty()) {
      partition0_sms = table.lower_slots;
      partition_slot = upload_slots(table.slot_of_sm, "walk-bench L2 partition slots");
    } else {
      std::printf("  the L2-partition placements are skipped\n");
    }
  }
  if (options.fabric_probe) {
    if (partition_slot == nullptr)
      throw Error(ErrorCode::kUnsupported,
                  "walk-bench --fabric-probe: the L2 probe found no clear partitions here");
    run_fabric_probe(partition_slot->as<int32_t>(), partition0_sms, runner.num_sms(), once);
    cuda_check(cudaDeviceSynchronize(), "walk-bench fabric probe");
    return 0;
  }
  // The operands, uninitialised: only their bytes' movement is timed.
  DeviceBuffer a(rows * std::max(H, I) * 2, "walk-bench rows");
  DeviceBuffer weights(E * 2 * I * H * 2, "walk-bench weights");
  // The walks to replay, each with its hold per 128 x 256 K-block (0: unpaced).
  struct Run {
    WalkCase walk;
    int32_t hold;
    int32_t stages;
    int32_t operands = kLoadA | kLoadB;
    int32_t grid = 0;         // CTAs; 0: one per SM
    int32_t held_stages = 2;  // as the GEMMs' consumers
  };
  std::vector<Run> runs;
  if (pace_sweep) {
    for (const int32_t hold : kPaceSweepHolds)
      for (const int32_t stages : {kStages, kDeepStages}) {
        WalkCase walk = kWalks[0];
        walk.paced = hold > 0;
        walk.spec.name = "128 x 256, " + std::to_string(stages) + " stages, " +
                         (hold > 0 ? "hold " + std::to_string(hold) : "unpaced");
        runs.push_back({walk, hold, stages});
      }
    for (const int32_t operands : {kLoadA, kLoadB})
      for (const int32_t hold : kCheckHolds) {
        WalkCase walk = kWalks[0];
        walk.spec.name = std::string("128 x 256, 3 stages, ") + (operands == kLoadA ? "A" : "B") +
                         " only, hold " + std::to_string(hold);
        runs.push_back({walk, hold, kStages, operands});
      }
    for (const int32_t divisor : kGridDivisors)
      for (const int32_t hold : kCheckHolds) {
        const int32_t grid = runner.num_sms() / divisor;
        WalkCase walk = kWalks[0];
        walk.spec.name =
            "128 x 256, 3 stages, " + std::to_string(grid) + " CTAs, hold " + std::to_string(hold);
        runs.push_back({walk, hold, kStages, kLoadA | kLoadB, grid});
      }
    // The ring's checks: stages that bring no bytes (the loop's own cost), the consumer holding
    // one stage instead of two, or releasing each as it lands (more stages loading), each
    // operand unpaced (what the loads alone sustain), and the walk on one CTA (no other SM
    // loading).
    const auto named = [&](const std::string& name) {
      WalkCase walk = kWalks[0];
      walk.spec.name = "128 x 256, 3 stages, " + name;
      return walk;
    };
    runs.push_back({named("no loads, hold 1024"), 1024, kStages, 0});
    for (const int32_t held : {1, 0})
      for (const int32_t hold : kCheckHolds)
        runs.push_back({named((held == 1 ? "one stage held, hold " : "released on landing, hold ") +
                              std::to_string(hold)),
                        hold, kStages, kLoadA | kLoadB, 0, held});
    for (const int32_t operands : {kLoadA, kLoadB}) {
      WalkCase walk = named(std::string(operands == kLoadA ? "A" : "B") + " only, unpaced");
      walk.paced = false;
      runs.push_back({walk, 0, kStages, operands});
    }
    runs.push_back({named("1 CTA, hold 1024"), 1024, kStages, kLoadA | kLoadB, 1});
    // The ring's shape at the GEMMs' pace: finer stages (the same bytes loading), and tiles
    // with epilogues, three and four stages deep.
    for (const auto& [name, stages, box_k, epilogue] :
         {std::tuple<const char*, int32_t, int32_t, int32_t>{"K-blocks of 32, 4 stages", 4, 32, 0},
          {"K-blocks of 32, 6 stages", 6, 32, 0},
          {"3 stages, epilogues", kStages, kBoxK, kEpilogueCycles},
          {"4 stages, epilogues", 4, kBoxK, kEpilogueCycles}}) {
      WalkCase walk = kWalks[0];
      walk.spec.name = std::string("128 x 256, ") + name + ", hold 1024";
      walk.box_k = box_k;
      walk.epilogue_cycles = epilogue;
      runs.push_back({walk, 1024, stages});
    }
  } else {
    for (const WalkCase& walk : kWalks)
      runs.push_back({walk, walk.paced ? kCyclesPer128x256 : 0, walk.stages});
  }
  DeviceBuffer clock_probe(kProbeSlots * sizeof(long long), "walk-bench clock probe");
  // The lockstep's counters (kernels/gemm/lockstep.h), zeroed once: the in-step walks'.
  DeviceBuffer lockstep_counters((kernels::kLockstepTicks + 2) * sizeof(unsigned long long),
                                 "walk-bench lockstep counters");
  cuda_check(cudaMemset(lockstep_counters.pointer, 0, lockstep_counters.bytes),
             "walk-bench lockstep counters");
  std::printf("  %-8s %-44s %7s %9s %9s %9s%s\n", "GEMM", "walk", "units", "asked GB", "wave GB",
              "ms",
              pace_sweep ? "   CTA 0: K-blocks, cycles each, GHz (hold x K-blocks / ms); per "
                           "K-block: consumer wait, % blocked, issue to landing (blocked), "
                           "stages ahead, producer wait"
                         : "");
  for (const WalkForm form : {WalkForm::kGateUp, WalkForm::kDown}) {
    const bool gate_up = form == WalkForm::kGateUp;
    const int64_t k = gate_up ? H : I, n_extent = gate_up ? I : H;
    for (const auto& [walk, hold, stages, operands, grid, held_stages] : runs) {
      if (walk.placement != Placement::kBlock && sm_slot == nullptr) continue;
      if (walk.placement == Placement::kL2Partition && partition_slot == nullptr) continue;
      std::vector<WalkLoad> loads = plan_walk(walk.spec, form, tiles, n_extent);
      if (walk.placement == Placement::kSmSplit) loads = split_waves(loads, runner.num_sms());
      if (walk.placement == Placement::kSmHalves || walk.placement == Placement::kSmParity)
        loads = place_by_expert_halves(loads, static_cast<int32_t>(E), runner.num_sms(),
                                       walk.placement == Placement::kSmParity);
      if (walk.placement == Placement::kL2Partition)
        loads = place_by_expert_halves(loads, static_cast<int32_t>(E), runner.num_sms(), false,
                                       partition0_sms);
      DeviceBuffer units(static_cast<int64_t>(loads.size() * sizeof(WalkLoad)), "walk units");
      cuda_check(cudaMemcpy(units.pointer, loads.data(), loads.size() * sizeof(WalkLoad),
                            cudaMemcpyHostToDevice),
                 "walk units upload");
      WalkParams p{};
      const int64_t a_dims[2] = {k, rows};
      const int64_t a_strides[1] = {k * 2};
      const int32_t a_box[2] = {walk.box_k, kRowBox};
      p.a_map = make_tensor_map(a.pointer, TmaElement::kBF16, 2, a_dims, a_strides, a_box, true,
                                "walk-bench rows");
      p.b_rows = gate_up ? walk.spec.tile_n / 2 : walk.spec.tile_n;
      p.b_box = p.b_rows;  // one box per map, at most 256 rows (TMA's limit)
      // gate/up: [E, 2I, H] as gate rows [0, I) and up rows [I, 2I) of each expert; down:
      // [E, H, I].
      const int64_t b_dims[3] = {k, n_extent, E};
      const int64_t b_strides[2] = {k * 2, (gate_up ? 2 : 1) * n_extent * k * 2};
      const int32_t b_box[3] = {walk.box_k, p.b_box, 1};
      p.b_map0 = make_tensor_map(weights.pointer, TmaElement::kBF16, 3, b_dims, b_strides, b_box,
                                 true, "walk-bench weights");
      p.b_map1 = gate_up ? make_tensor_map(weights.as<unsigned char>() + n_extent * k * 2,
                                           TmaElement::kBF16, 3, b_dims, b_strides, b_box, true,
                                           "walk-bench up weights")
                         : p.b_map0;
      p.units = units.as<int4>();
      p.num_units = static_cast<int32_t>(loads.size());
      p.k_blocks = static_cast<int32_t>(k / walk.box_k);
      p.gate_up = gate_up ? 1 : 0;
      p.n_extent = static_cast<int32_t>(n_extent);
      // The hold is per 128 x 256 x 64 K-block: a unit's K-block takes its share.
      p.cycles_per_a_box = walk.paced ? hold * walk.spec.tile_n / 256 * walk.box_k / kBoxK : 0;
      p.clock_probe = pace_sweep ? clock_probe.as<long long>() : nullptr;
      p.stages = stages;
      p.operands = operands;
      p.held_stages = held_stages;
      p.box_k = walk.box_k;
      p.stage_bytes = stage_bytes_of(walk.spec.tile_rows, walk.box_k);
      p.epilogue_cycles = walk.epilogue_cycles;
      if (stages > kMaxStages || stages * p.stage_bytes > kRingBytes)
        throw Error(ErrorCode::kInternal,
                    "walk-bench: " + walk.spec.name + " asks for " + std::to_string(stages) +
                        " stages of " + std::to_string(p.stage_bytes) + " bytes; the ring holds " +
                        std::to_string(kRingBytes) + " bytes in at most " +
                        std::to_string(kMaxStages) + " stages");
      p.sm_slot = walk.placement == Placement::kBlock         ? nullptr
                  : walk.placement == Placement::kL2Partition ? partition_slot->as<int32_t>()
                                                              : sm_slot->as<int32_t>();
      p.wait = kernels::WaitContext{20'000'000'000ull, 0, nullptr};
      p.speed_spread_pct = walk.speed_spread_pct;
      p.lockstep = {};
      p.max_units = 0;
      if (walk.lockstep_lead > 0) {
        // The most non-padding units a CTA walks (its slot s takes s, s + ctas, ...).
        const int32_t ctas = grid > 0 ? grid : runner.num_sms();
        std::vector<int32_t> per_slot(ctas, 0);
        for (size_t u = 0; u < loads.size(); ++u)
          if (loads[u].a_boxes > 0) ++per_slot[u % ctas];
        p.max_units = *std::max_element(per_slot.begin(), per_slot.end());
        unsigned long long* words = lockstep_counters.as<unsigned long long>();
        p.lockstep = {words, words + kernels::kLockstepTicks, words + kernels::kLockstepTicks + 1,
                      walk.lockstep_lead};
      }
      // Each launch a new epoch of the lockstep's counters, as the layer advances them.
      const auto launch = [&] {
        runner.launch(p, grid);
        if (p.lockstep.ticks != nullptr)
          cuda_check(kernels::launch_advance_epoch(p.lockstep.epoch, nullptr),
                     "walk-bench lockstep epoch");
      };
      // With `once`, no warm-up: the one launch is what ncu profiles.
      const double ms = median_event_ms(launch, once ? 1 : 5, once ? 0 : 1);
      const double asked = walk_asked_bytes(walk.spec, form, loads, n_extent, k) / 1e9;
      const double wave = walk_wave_unique_bytes(walk.spec, form, loads, n_extent, k,
                                                 grid > 0 ? grid : runner.num_sms()) /
                          1e9;
      // A split run (one operand, or none) asks for part of the walk's bytes: no byte columns.
      const bool whole = operands == (kLoadA | kLoadB);
      std::printf("  %-8s %-44s %7zu %9s %9s %9.3f", gate_up ? "gate/up" : "down",
                  walk.spec.name.c_str(),
                  static_cast<size_t>(std::count_if(
                      loads.begin(), loads.end(), [](const WalkLoad& l) { return l.a_boxes > 0; })),
                  whole ? gb(asked).c_str() : "-", whole ? gb(wave).c_str() : "-", ms);
      if (pace_sweep) {
        // The last run's block 0: its K-blocks, cycles per K-block and SM clock, and the time
        // its holds alone take over the measured time (1.00: the pace sets the time).
        long long probe[kProbeSlots];
        cuda_check(cudaMemcpy(probe, clock_probe.pointer, sizeof(probe), cudaMemcpyDeviceToHost),
                   "walk-bench clock probe");
        const double cycles = static_cast<double>(probe[kProbeEndClock] - probe[kProbeStartClock]);
        const double ns = static_cast<double>(probe[kProbeEndNs] - probe[kProbeStartNs]);
        const double ghz = ns > 0 ? cycles / ns : 0;
        const double k_blocks = std::max(1.0, static_cast<double>(probe[kProbeKBlocks]));
        const double blocked = static_cast<double>(probe[kProbeBlockedWaits]);
        std::printf("   %6.0f %7.0f %5.2f (%4.2f) %6.0f %4.0f%% %6.0f %5.2f %6.0f", k_blocks,
                    cycles / k_blocks, ghz, ghz > 0 ? hold * k_blocks / (ghz * 1e6) / ms : 0,
                    probe[kProbeConsumerWait] / k_blocks, 100 * blocked / k_blocks,
                    blocked > 0 ? probe[kProbeIssueToReady] / blocked : 0,
                    probe[kProbeProducerLead] / k_blocks, probe[kProbeProducerWait] / k_blocks);
      }
      std::printf("\n");
    }
  }
  cuda_check(cudaDeviceSynchronize(), "walk-bench");
  return 0;
}

}  // namespace mok
