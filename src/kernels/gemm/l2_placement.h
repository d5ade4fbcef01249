// MoeConfig::gemm_l2_placement (issue 16): the standalone expert GEMM's row-tile forms with
// each L2 partition's SMs on their own share of the row tiles. The row-tile GEMMs are bound by
// the fabric between the L2's two partitions, and a line read by SMs of both partitions crosses
// it once, a line read by one partition's SMs half the time (when its home is the other one).
// So the SMs of partition 0 (found at layer creation by layer/l2_partitions.h's probe) walk row
// tiles [0, split) of the launch and the others [split, M), each group over all column tiles in
// the walk's usual order: an expert's rows and weight tiles are read by one partition, but for
// the expert that straddles the split.
//
// A CTA learns its slot from its SM id (the slot table: partition 0's SMs get slots
// [0, lower_slots), the others the rest), and claims it for the launch: a CTA whose SM already
// ran one of this launch's CTAs (another stream holding SMs, an SM lost to the driver) finds the
// slot taken and claims the first free one, so every slot runs exactly once whatever the
// residency. Claims are marked with the launch's number, an epoch counter the layer advances
// after each launch (stream-ordered, CUDA-graph capturable), so nothing is reset.
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

struct L2Placement {
  const int32_t* slot_of_sm = nullptr;  // [num_sm_ids]: SM id -> slot (-1: none); null: off
  int32_t num_sm_ids = 0;
  int32_t lower_slots = 0;                    // slots of partition 0's SMs
  unsigned long long* claims = nullptr;       // [slots]: the last launch number that claimed each
  const unsigned long long* epoch = nullptr;  // launches so far
};

// The units a CTA walks: first, first + stride, ... below num_units, over row tiles
// [m_lo, m_lo + m_units) of the launch (relative to its first) and every column tile.
struct CtaWalk {
  int32_t first;
  int32_t stride;
  int32_t m_lo;
  int32_t m_units;
  int32_t num_units;
};

// The walk of slot `slot` of `grid` under the placement: partition 0's slots [0, lower_slots)
// take row tiles [0, split), the others [split, m_units), split in proportion to the slots.
MOK_HOST_DEVICE inline CtaWalk l2_half_walk(int32_t slot, int32_t grid, int32_t lower_slots,
                                            int32_t m_units, int32_t num_n_tiles) {
  const int32_t split =
      static_cast<int32_t>((static_cast<int64_t>(m_units) * lower_slots + grid / 2) / grid);
  CtaWalk walk;
  if (slot < lower_slots) {
    walk = {slot, lower_slots, 0, split, 0};
  } else {
    walk = {slot - lower_slots, grid - lower_slots, split, m_units - split, 0};
  }
  walk.num_units = walk.m_units * num_n_tiles;
  return walk;
}

#if defined(__CUDACC__)
// Thread 0 of a CTA: its slot for this launch (see above). As many slots as CTAs, so the scan
// always finds one.
__device__ __forceinline__ int32_t claim_l2_slot(const L2Placement& placement) {
  const unsigned long long launch = *placement.epoch + 1;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  int32_t slot = sm < static_cast<uint32_t>(placement.num_sm_ids) ? placement.slot_of_sm[sm] : -1;
  if (slot >= 0 && slot < static_cast<int32_t>(gridDim.x) &&
      atomicMax(&placement.claims[slot], launch) < launch)
    return slot;
  for (slot = 0; slot < static_cast<int32_t>(gridDim.x); ++slot)
    if (atomicMax(&placement.claims[slot], launch) < launch) return slot;
  return 0;  // unreachable: gridDim.x CTAs claim gridDim.x slots
}
#endif

}  // namespace mok::kernels
