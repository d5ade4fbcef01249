// Which SMs share an L2 partition (layer/l2_partitions.h): the probe's launch and the
// clustering of its latencies.
#include "layer/l2_partitions.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "layer/cuda_buffer.h"
#include "mok/error.h"

namespace mok {

L2PartitionMap cluster_l2_partitions(const std::vector<int32_t>& sm_ids,
                                     const std::vector<uint32_t>& latency) {
  const size_t sms = sm_ids.size();
  if (sms < 2 || latency.size() != sms * kL2ProbeLines)
    throw Error(ErrorCode::kInvalidArgument,
                "cluster_l2_partitions: " + std::to_string(sms) + " SMs and " +
                    std::to_string(latency.size()) + " latencies; valid: >= 2 SMs and " +
                    std::to_string(kL2ProbeLines) + " latencies per SM");
  // far[s][l]: SM s sees line l above the widest gap between the line's sorted latencies (the
  // gap between its near and far SMs; a median would cut into the larger side where the
  // partitions differ in size).
  std::vector<uint8_t> far(latency.size());
  double sums[2] = {0, 0};
  int64_t counts[2] = {0, 0};
  for (int32_t line = 0; line < kL2ProbeLines; ++line) {
    std::vector<uint32_t> column(sms);
    for (size_t s = 0; s < sms; ++s) column[s] = latency[s * kL2ProbeLines + line];
    std::sort(column.begin(), column.end());
    uint32_t threshold = column[0], widest = 0;
    for (size_t i = 0; i + 1 < sms; ++i)
      if (column[i + 1] - column[i] > widest) {
        widest = column[i + 1] - column[i];
        threshold = column[i];
      }
    for (size_t s = 0; s < sms; ++s) {
      const uint32_t value = latency[s * kL2ProbeLines + line];
      const int side = value > threshold ? 1 : 0;
      far[s * kL2ProbeLines + line] = static_cast<uint8_t>(side);
      sums[side] += value;
      ++counts[side];
    }
  }
  L2PartitionMap map;
  map.sm_ids = sm_ids;
  map.partition.assign(sms, 0);
  map.min_agreement = kL2ProbeLines;
  for (size_t s = 0; s < sms; ++s) {
    int32_t agree = 0;
    for (int32_t line = 0; line < kL2ProbeLines; ++line)
      agree += far[s * kL2ProbeLines + line] == far[line] ? 1 : 0;
    map.partition[s] = agree * 2 >= kL2ProbeLines ? 0 : 1;
    map.min_agreement =
        std::min(map.min_agreement, map.partition[s] == 0 ? agree : kL2ProbeLines - agree);
    ++map.sms_in[map.partition[s]];
  }
  map.near_cycles = counts[0] > 0 ? sums[0] / counts[0] : 0;
  map.far_cycles = counts[1] > 0 ? sums[1] / counts[1] : 0;
  map.clear = map.sms_in[1] > 0 && map.min_agreement * 4 >= kL2ProbeLines * 3;
  return map;
}

std::string L2PartitionMap::describe() const {
  char line[256];
  std::snprintf(line, sizeof(line),
                "%s: %d + %d SMs, the least sure SM on its side for %d of %d lines; near lines "
                "%.0f cycles, far %.0f",
                clear ? "two L2 partitions" : "no clear L2 partitions", sms_in[0], sms_in[1],
                min_agreement, kL2ProbeLines, near_cycles, far_cycles);
  std::string text = line;
  if (!clear) return text;
  text += "; partition 0's SM ids:";
  for (size_t s = 0; s < sm_ids.size(); ++s)
    if (partition[s] == 0) {
      text += ' ';
      text += std::to_string(sm_ids[s]);
    }
  return text;
}

L2SlotTable l2_slot_table(const L2PartitionMap& map) {
  L2SlotTable table;
  if (!map.clear || map.sm_ids.empty()) return table;
  std::vector<int32_t> ids = map.sm_ids;
  std::sort(ids.begin(), ids.end());
  if (ids.front() < 0 || std::adjacent_find(ids.begin(), ids.end()) != ids.end()) return table;
  std::vector<int32_t> partition_of(ids.back() + 1, -1);
  for (size_t s = 0; s < map.sm_ids.size(); ++s) partition_of[map.sm_ids[s]] = map.partition[s];
  table.slot_of_sm.assign(ids.back() + 1, -1);
  int32_t next[2] = {0, map.sms_in[0]};
  for (const int32_t id : ids) table.slot_of_sm[id] = next[partition_of[id]]++;
  table.lower_slots = map.sms_in[0];
  return table;
}

L2PartitionMap probe_l2_partitions(int32_t num_sms) {
  const int32_t sms = num_sms;
  DeviceBuffer lines(int64_t{kL2ProbeLines} * kernels::kL2ProbeLineStrideWords * 4,
                     "L2 probe lines");
  DeviceBuffer latency(int64_t{sms} * kL2ProbeLines * 4, "L2 probe latencies");
  DeviceBuffer ids(int64_t{sms} * 4, "L2 probe SM ids");
  cuda_check(cudaMemset(lines.pointer, 0, static_cast<size_t>(lines.bytes)), "cudaMemset");
  cuda_check(kernels::launch_l2_probe(lines.as<uint32_t>(), latency.as<uint32_t>(),
                                      ids.as<int32_t>(), sms, nullptr),
             "L2 partition probe launch");
  std::vector<uint32_t> host_latency(static_cast<size_t>(sms) * kL2ProbeLines);
  std::vector<int32_t> host_ids(sms);
  cuda_check(cudaMemcpy(host_latency.data(), latency.pointer, host_latency.size() * 4,
                        cudaMemcpyDeviceToHost),
             "L2 probe latencies");
  cuda_check(cudaMemcpy(host_ids.data(), ids.pointer, host_ids.size() * 4, cudaMemcpyDeviceToHost),
             "L2 probe SM ids");
  return cluster_l2_partitions(host_ids, host_latency);
}

}  // namespace mok
