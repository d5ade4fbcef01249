// Which SMs share an L2 partition, from atomic latencies (MoeConfig::gemm_l2_placement,
// `mok walk-bench`; issue 16). H100 and H200 split the L2 into two partitions joined by a
// fabric, and each SM reaches the lines homed in its own partition faster than the others. One
// CTA per SM times a dependent chain of atomic adds of 0 (performed at each line's home slice,
// which a partition's copies of far lines cannot serve) to each of kL2ProbeLines lines spread
// over the address space (kernels/stages/l2_probe.cu). Two SMs of one partition see the same
// lines near and far, two of different partitions the opposite. The clustering is plain host
// code, CPU-tested on made-up latencies.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/stages/launch.h"

namespace mok {

using kernels::kL2ProbeLines;

struct L2PartitionMap {
  bool clear = false;              // every SM sided with one partition on >= 3/4 of the lines
  std::vector<int32_t> sm_ids;     // the SMs probed, in block order
  std::vector<int32_t> partition;  // of each SM in sm_ids: 0 (SM sm_ids[0]'s) or 1
  int32_t sms_in[2] = {0, 0};      // SMs of each partition
  int32_t min_agreement = 0;       // lines on which the least sure SM agrees with its partition
  double near_cycles = 0;          // mean latency of the lines an SM sees near (below the gap)
  double far_cycles = 0;           // and far
  std::string describe() const;    // one line: sizes, agreement, latencies (or why unclear)
};

// Clusters `latency` (SM-major: latency[s * kL2ProbeLines + line], SM cycles per load) of the
// SMs `sm_ids`: a line is far for an SM when its latency lies above the widest gap between the
// line's latencies over all SMs; SMs that agree with sm_ids[0] on at least half the lines are
// its partition.
L2PartitionMap cluster_l2_partitions(const std::vector<int32_t>& sm_ids,
                                     const std::vector<uint32_t>& latency);

// MoeConfig::gemm_l2_placement's slot table (kernels/gemm/l2_placement.h): partition 0's SMs,
// by ascending id, get slots [0, lower_slots), partition 1's the rest; ids probed by no CTA -1.
// Empty (slot_of_sm empty) unless `map` is clear and probed each SM once.
struct L2SlotTable {
  std::vector<int32_t> slot_of_sm;  // indexed by SM id
  int32_t lower_slots = 0;
};
L2SlotTable l2_slot_table(const L2PartitionMap& map);

// Probes the current GPU, whose SM count is `num_sms` (one CTA per SM; needs every SM free), and
// clusters the result. Throws mok::Error if a CUDA call fails.
L2PartitionMap probe_l2_partitions(int32_t num_sms);

}  // namespace mok
