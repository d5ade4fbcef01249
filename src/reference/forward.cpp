// CPU reference of the MoE layer, forward, with expert parallelism emulated the way the GPU
// layer works: each owner rank pulls the routed rows of x from their source ranks, runs its
// experts segment by segment, and pushes every expert output row (bf16) into the source rank's
// combine slot [token * K + k]; each source rank then sums its slots in fixed order with the
// shared expert's output.
#include <cmath>
#include <vector>

#include "ep_exchange.h"
#include "expert_math.h"
#include "fp8_emulation.h"
#include "gemm_f32.h"
#include "mok/reference.h"

namespace mok::reference {

namespace {

using detail::ExpertWeights;
using detail::OwnerSchedule;

// Runs the routed experts of one owner rank and pushes their output rows into the combine
// slots of the source ranks.
void run_owner_experts(ThreadPool& pool, const MoeShape& shape, bool fp8,
                       const ForwardArgs& owner_args, const OwnerSchedule& schedule,
                       const std::vector<const bf16*>& source_x,
                       std::vector<std::vector<bf16>>& combine_slots) {
  const int64_t hidden = shape.hidden, inter = shape.intermediate, top_k = shape.top_k;
  const std::vector<bf16> received = detail::pull_rows(pool, schedule, source_x, hidden);
  ExpertWeights weights;
  for (int64_t expert = 0; expert < shape.num_local_experts(); ++expert) {
    const int64_t rows = schedule.routed_rows(expert);
    if (rows == 0) continue;
    const int64_t begin = schedule.segment_begin(expert);
    std::vector<float> x_rows(static_cast<size_t>(rows * hidden));
    detail::gather_segment(pool, schedule, received.data(), begin, rows, hidden, x_rows.data());

    detail::load_expert_weights(pool, detail::routed_matrices(shape, owner_args, expert), hidden,
                                inter, detail::WeightsFor::kForward, fp8, weights);
    const detail::SwigluRows act =
        detail::expert_swiglu(pool, weights, x_rows.data(), rows, shape.swiglu_limit);
    std::vector<float> y(static_cast<size_t>(rows * hidden));
    detail::expert_down(pool, weights, act.hidden.data(), rows, y.data());

    // Push combine: one writer per slot.
    pool.parallel_for(rows, [&](int64_t row) {
      const PairCoord pair = schedule.pair_of_row(begin + row);
      bf16* slot = combine_slots[pair.src_rank].data() + (pair.token * top_k + pair.k) * hidden;
      for (int64_t n = 0; n < hidden; ++n) slot[n] = float_to_bf16(y[row * hidden + n]);
    });
  }
}

// The shared expert's output rows for all tokens of one rank: [T, H], bf16 values as fp32.
std::vector<float> shared_expert_output(ThreadPool& pool, const MoeShape& shape, bool fp8,
                                        const ForwardArgs& args) {
  const int64_t tokens = shape.num_tokens, hidden = shape.hidden;
  std::vector<float> x_rows(static_cast<size_t>(tokens * hidden));
  convert_bf16_to_float(pool, args.x.data_as<const bf16>(), tokens * hidden, x_rows.data());
  ExpertWeights weights;
  detail::load_expert_weights(pool, detail::shared_matrices(args), hidden,
                              shape.shared_intermediate, detail::WeightsFor::kForward, fp8,
                              weights);
  const detail::SwigluRows act =
      detail::expert_swiglu(pool, weights, x_rows.data(), tokens, shape.swiglu_limit);
  std::vector<float> y(static_cast<size_t>(tokens * hidden));
  detail::expert_down(pool, weights, act.hidden.data(), tokens, y.data());
  return y;
}

// The source rank's epilogue: out[t] = bf16(fma chain over k of w * y_k, started at y_shared).
void combine_at_source(ThreadPool& pool, const MoeShape& shape, const ForwardArgs& args,
                       const std::vector<float>& shared_y, const std::vector<bf16>& slots) {
  const int64_t hidden = shape.hidden, top_k = shape.top_k;
  const float* router_weights = args.router_weights.data_as<const float>();
  bf16* out = args.out.data_as<bf16>();
  pool.parallel_for(shape.num_tokens, [&](int64_t token) {
    for (int64_t n = 0; n < hidden; ++n) {
      float acc = shared_y.empty() ? 0.0f : shared_y[token * hidden + n];
      for (int64_t k = 0; k < top_k; ++k) {
        if (read_expert_id(args.top_experts, token * top_k + k) < 0) continue;
        const float y = bf16_to_float(slots[(token * top_k + k) * hidden + n]);
        acc = std::fmaf(router_weights[token * top_k + k], y, acc);
      }
      out[token * hidden + n] = float_to_bf16(acc);
    }
  });
}

}  // namespace

void forward_ep(const MoeShape& shape, const std::vector<ForwardArgs>& rank_args,
                const Options& options) {
  detail::validate_forward_ranks("forward_ep", shape, rank_args, options.precision);
  const bool fp8 = options.precision == Precision::kFP8Block;
  if (fp8) detail::check_fp8_shape("forward_ep", shape);
  ThreadPool pool(resolve_num_threads(options.num_threads));
  const int32_t num_ranks = shape.num_ranks;

  std::vector<const ForwardArgs*> rank_ptrs;
  std::vector<const bf16*> source_x;
  for (const ForwardArgs& args : rank_args) {
    rank_ptrs.push_back(&args);
    source_x.push_back(args.x.data_as<const bf16>());
  }
  const std::vector<int64_t> routing = detail::gather_routing(shape, rank_ptrs);

  // Combine slots of every source rank, [T * K, H] bf16: written by the owners, read by the
  // source. Slots of -1 routes stay unwritten and are never read.
  std::vector<std::vector<bf16>> combine_slots(num_ranks);
  for (auto& slots : combine_slots)
    slots.resize(static_cast<size_t>(shape.num_tokens * shape.top_k * shape.hidden));

  for (int32_t owner = 0; owner < num_ranks; ++owner) {
    const OwnerSchedule schedule(shape, routing, owner);
    run_owner_experts(pool, shape, fp8, rank_args[owner], schedule, source_x, combine_slots);
  }
  for (int32_t source = 0; source < num_ranks; ++source) {
    std::vector<float> shared_y;
    if (shape.has_shared_expert())
      shared_y = shared_expert_output(pool, shape, fp8, rank_args[source]);
    combine_at_source(pool, shape, rank_args[source], shared_y, combine_slots[source]);
    combine_slots[source] = {};
  }
}

void forward(const MoeShape& shape, const ForwardArgs& args, const Options& options) {
  detail::require_single_rank("forward", shape);
  forward_ep(shape, std::vector<ForwardArgs>{args}, options);
}

}  // namespace mok::reference
