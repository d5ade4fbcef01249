// The workspace of a GpuLayer (gpu_layer_state.h): every buffer the layer's calls use,
// allocated once, and every counter buffer zeroed once (the kernels' epochs mean nothing is
// reset between calls).
//
//   routed        the routing schedule (ScheduleLayout of this rank) and the [ring_rows, I]
//                 buffers of the routed experts (h, g, u, d_g, d_u)
//   rows          [ring_rows, H] bf16: routed x rows in schedule order (padding rows zero)
//   d_out_rows    [ring_rows, H] bf16: routed d_out rows
//   expert_out    [max_rows, H] bf16: the down GEMM's output rows (backward: the dx rows) in
//                 schedule order; the combine reads pair p's row pair_row[p]
//   shared, shared_out  the shared expert's own "schedule" (one expert, T rows, identity row
//                 map), its [ceil128(T), Is] buffers and its output [T, H]
//   *_state       counter buffers (layouts: kernels/common/counter_layouts.h)
//   diagnosis     a WaitDiagnosis in mapped pinned host memory (kernels/common/wait.cuh)
#include <algorithm>
#include <string>
#include <vector>

#include "layer/expert_engine.h"
#include "layer/gpu_layer_state.h"
#include "layer/l2_partitions.h"
#include "layer/task_trace_capacity.h"
#include "layer/token_exchange.h"
#include "mok/schedule.h"

namespace mok {

GpuLayer::State::State() = default;

GpuLayer::State::~State() {
  if (diagnosis != nullptr) cudaFreeHost(diagnosis);
}

namespace {

void zeroed(DeviceBuffer& buffer, int64_t words, const char* what) {
  buffer.allocate(words * 8, what);
  cuda_check(cudaMemset(buffer.pointer, 0, buffer.bytes), std::string("zero ") + what);
}

// A ticket counter and its launch epoch (kernels/gemm/tile_tickets.h) in `buffer`, zeroed.
kernels::GemmTickets zeroed_tickets(DeviceBuffer& buffer, const char* what) {
  zeroed(buffer, 2, what);
  kernels::GemmTickets tickets;
  tickets.counter = buffer.as<unsigned long long>();
  tickets.epoch = tickets.counter + 1;
  return tickets;
}

// MoeConfig::gemm_l2_placement: which SMs share an L2 partition (a probe of this GPU), their
// slots, and the claims the GEMMs mark (kernels/gemm/l2_placement.h).
void plan_l2_placement(GpuLayer::State& s) {
  const L2PartitionMap map = probe_l2_partitions(s.sm_count);
  const L2SlotTable table = l2_slot_table(map);
  s.l2_placement_report = map.describe();
  if (table.slot_of_sm.empty()) {
    s.l2_placement_report += "; the expert GEMMs keep the block-index walk";
    return;
  }
  s.l2_slot_of_sm.allocate(static_cast<int64_t>(table.slot_of_sm.size() * sizeof(int32_t)),
                           "L2 placement slot table");
  cuda_check(cudaMemcpy(s.l2_slot_of_sm.pointer, table.slot_of_sm.data(), s.l2_slot_of_sm.bytes,
                        cudaMemcpyHostToDevice),
             "upload the L2 placement slot table");
  zeroed(s.l2_claims, s.sm_count + 1, "L2 placement claims and epoch");
  s.l2_placement.slot_of_sm = s.l2_slot_of_sm.as<int32_t>();
  s.l2_placement.num_sm_ids = static_cast<int32_t>(table.slot_of_sm.size());
  s.l2_placement.lower_slots = table.lower_slots;
  s.l2_placement.claims = s.l2_claims.as<unsigned long long>();
  s.l2_placement.epoch = s.l2_claims.as<unsigned long long>() + s.sm_count;
  s.l2_placement_report += "; the expert GEMMs walk by partition";
}

}  // namespace

std::unique_ptr<GpuLayer::State> make_layer_state(const MoeShape& shape, const MoeConfig& config,
                                                  int32_t rank) {
  auto state = std::make_unique<GpuLayer::State>();
  GpuLayer::State& s = *state;
  s.shape = shape;
  s.config = with_auto_choices(config, shape);  // every later use reads s.config
  s.rank = rank;
  cuda_check(cudaGetDevice(&s.device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, s.device),
             "SM count");
  int major = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s.device),
             "compute capability");
  if (major != 9)
    throw Error(ErrorCode::kUnsupported, "GpuLayer: device " + std::to_string(s.device) +
                                             " has compute capability " + std::to_string(major) +
                                             ".x; mok's kernels need Hopper (9.0, sm_90a)");

  if (config.gemm_l2_placement) plan_l2_placement(s);
  if (s.config.gemm_lockstep_k_blocks > 0) {
    zeroed(s.lockstep_counters, kernels::kLockstepTicks + 2, "GEMM lockstep counters");
    unsigned long long* words = s.lockstep_counters.as<unsigned long long>();
    s.lockstep.ticks = words;
    s.lockstep.started = words + kernels::kLockstepTicks;
    s.lockstep.epoch = words + kernels::kLockstepTicks + 1;
    s.lockstep.lead_k_blocks = s.config.gemm_lockstep_k_blocks;
  }
  s.fp8_tile_tickets = zeroed_tickets(s.fp8_ticket_counters, "FP8 192-row tile tickets");
  if (config.gemm_tiles_by_ticket)
    s.tickets = zeroed_tickets(s.ticket_counters, "GEMM tile tickets");

  // The minibatch this layer runs with (an automatic one from the shape and this GPU's SMs):
  // every later use reads s.config.
  s.config.minibatch_size = minibatch_rows(config, shape, s.sm_count);

  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate;
  const ScheduleParams params = schedule_params(shape, rank);
  s.routed.layout = ScheduleLayout::make(params);
  const int64_t max_rows = params.max_rows();
  // The macrobatch ring: one macrobatch when it covers the worst case (the default when that
  // fits kAutoMacrobatchRingBytes).
  s.ring_rows = macrobatch_ring_rows(s.config, shape, max_rows, s.sm_count);
  s.num_macrobatches = static_cast<int32_t>((max_rows + s.ring_rows - 1) / s.ring_rows);
  s.routed.schedule.allocate(s.routed.layout.total_bytes, "schedule buffer");
  s.routed.allocate(s.ring_rows, I, shape.num_local_experts(), config, /*router_weights=*/true);
  s.rows.allocate(s.ring_rows * H * 2, "routed rows buffer (one macrobatch)");
  s.d_out_rows.allocate(s.ring_rows * H * 2, "routed d_out rows buffer (one macrobatch)");
  s.expert_out.allocate(max_rows * H * 2, "expert output rows buffer");
  if (s.num_macrobatches > 1) {
    // One [M x N] fp32 weight gradient per slot, in 128 x 256 tiles (expert_gemm.cu).
    s.partial_floats =
        std::max(round_up(I, 128) * round_up(H, 256), round_up(H, 128) * round_up(I, 256));
    s.wgrad_partials.allocate(3 * 2 * s.partial_floats * 4, "weight-gradient partial sums");
  }
  if (config.precision == Precision::kFP8Block)
    s.fp8_routed.allocate(s.ring_rows, H, I, shape.num_local_experts());
  // The shared expert's row tiles (its counters follow the routed ones'; its tiles run in the
  // persistent forward's last launch).
  const int64_t shared_tiles = shape.has_shared_expert() ? (T + 127) / 128 : 0;
  // FP8 counts its fused gather's rows per 64-row chunk (MoeConfig::fp8_gather_in_gate_up).
  s.gather_counters = {params.max_tiles() * (config.precision == Precision::kFP8Block ? 2 : 1)};
  s.forward_counters = {params.max_tiles(), shared_tiles};
  s.backward_counters = {params.max_tiles(), shape.num_local_experts(), shared_tiles};
  zeroed(s.gather_state, s.gather_counters.words(), "gather counters");
  zeroed(s.persistent_state, s.forward_counters.words(), "persistent forward counters");
  if (config.persistent_backward)
    zeroed(s.persistent_backward_state, s.backward_counters.words(),
           "persistent backward counters");

  if (config.trace_tasks) {
    // Events are indexed by ticket: one per ticket of the worst-case schedule.
    const int32_t minibatch_tiles = static_cast<int32_t>(s.config.minibatch_size / 128);
    s.forward_trace_capacity = forward_trace_capacity(params.max_tiles(), minibatch_tiles, I, H,
                                                      shared_tiles, shape.shared_intermediate);
    s.backward_trace_capacity =
        backward_trace_capacity(params.max_tiles(), minibatch_tiles, I, H,
                                shape.num_local_experts(), shared_tiles, shape.shared_intermediate);
    s.forward_trace.allocate(s.forward_trace_capacity * sizeof(TaskTraceEvent),
                             "persistent forward task trace");
    s.backward_trace.allocate(s.backward_trace_capacity * sizeof(TaskTraceEvent),
                              "persistent backward task trace");
    for (DeviceBuffer* trace : {&s.forward_trace, &s.backward_trace})
      cuda_check(cudaMemset(trace->pointer, 0xff, trace->bytes), "empty a task trace");
  }

  if (shape.has_shared_expert()) {
    // The shared expert runs through the same kernels as one expert that every token visits:
    // a fixed schedule with an identity row map, built once here.
    ScheduleParams shared_params;
    shared_params.num_ranks = 1;
    shared_params.tokens_per_rank = static_cast<int32_t>(T);
    shared_params.top_k = 1;
    shared_params.num_experts = 1;
    s.shared.layout = ScheduleLayout::make(shared_params);
    std::vector<int32_t> identity(static_cast<size_t>(T), 0);
    std::vector<char> host(s.shared.layout.output_bytes);
    build_schedule_host(s.shared.layout, identity.data(), DType::kInt32, host.data());
    s.shared.schedule.allocate(s.shared.layout.total_bytes, "shared expert schedule");
    cuda_check(
        cudaMemcpy(s.shared.schedule.pointer, host.data(), host.size(), cudaMemcpyHostToDevice),
        "upload shared expert schedule");
    s.shared.allocate(round_up(std::max<int64_t>(T, 1), 128), shape.shared_intermediate, 1, config,
                      /*router_weights=*/false);
    s.shared_out.allocate(T * H * 2, "shared output buffer");
    if (config.precision == Precision::kFP8Block)
      s.fp8_shared.allocate(round_up(std::max<int64_t>(T, 1), 128), H, shape.shared_intermediate,
                            1);
  }

  cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&s.diagnosis), sizeof(kernels::WaitDiagnosis),
                           cudaHostAllocMapped),
             "diagnosis record");
  *s.diagnosis = kernels::WaitDiagnosis{};
  cuda_check(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.diagnosis_device), s.diagnosis, 0),
      "diagnosis record device pointer");
  if (config.check_finite) {
    s.non_finite_record.allocate(sizeof(unsigned long long), "non-finite input record");
    cuda_check(cudaMemset(s.non_finite_record.pointer, 0xff, s.non_finite_record.bytes),
               "clear the non-finite input record");
  }
  return state;
}

}  // namespace mok
