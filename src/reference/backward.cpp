// CPU reference of the MoE layer, backward, mirroring the forward's data movement: each owner
// rank pulls the d_out rows (and x rows, to recompute g, u, h: no saved context) of the tokens
// routed to it, computes dh_raw, the router-weight gradient and SwiGLU backward per segment,
// pushes every dx row (bf16) and router-weight gradient into the source rank's slot
// [token * K + k], and sums its weight gradients over the segment's rows in schedule order.
// Each source rank then sums its dx slots in fixed order after the shared expert's dx.
#include <algorithm>
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

// What the owners push back to a source rank.
struct SourceSlots {
  std::vector<bf16> dx;     // [T * K, H]: dx row of each routed slot
  float* d_router_weights;  // the source's output [T, K], written in place (one writer per slot)
};

void run_owner_experts(ThreadPool& pool, const MoeShape& shape, bool fp8,
                       const BackwardArgs& owner_args, const OwnerSchedule& schedule,
                       const std::vector<BackwardArgs>& rank_args,
                       std::vector<SourceSlots>& sources) {
  const int64_t hidden = shape.hidden, inter = shape.intermediate, top_k = shape.top_k;
  std::vector<const bf16*> source_x, source_d_out;
  for (const BackwardArgs& args : rank_args) {
    source_x.push_back(args.forward.x.data_as<const bf16>());
    source_d_out.push_back(args.d_out.data_as<const bf16>());
  }
  const std::vector<bf16> received_x = detail::pull_rows(pool, schedule, source_x, hidden);
  const std::vector<bf16> received_d_out = detail::pull_rows(pool, schedule, source_d_out, hidden);

  const ForwardArgs& owner = owner_args.forward;
  ExpertWeights weights;
  weights.hidden = hidden;
  weights.intermediate = inter;
  for (int64_t expert = 0; expert < shape.num_local_experts(); ++expert) {
    const int64_t rows = schedule.routed_rows(expert);
    const int64_t begin = schedule.segment_begin(expert);
    std::vector<float> x_rows(static_cast<size_t>(rows * hidden));
    std::vector<float> d_out_rows(static_cast<size_t>(rows * hidden));
    std::vector<float> row_weights(static_cast<size_t>(rows));
    detail::gather_segment(pool, schedule, received_x.data(), begin, rows, hidden, x_rows.data());
    detail::gather_segment(pool, schedule, received_d_out.data(), begin, rows, hidden,
                           d_out_rows.data());
    for (int64_t row = 0; row < rows; ++row) {
      const PairCoord pair = schedule.pair_of_row(begin + row);
      row_weights[row] =
          rank_args[pair.src_rank]
              .forward.router_weights.data_as<const float>()[pair.token * top_k + pair.k];
    }

    // An expert without rows needs no operands: expert_backward only zeroes its gradients.
    if (rows > 0)
      detail::load_expert_weights(pool, detail::routed_matrices(shape, owner, expert), hidden,
                                  inter, detail::WeightsFor::kBackward, fp8, weights);

    std::vector<float> d_router_weights(static_cast<size_t>(rows));
    std::vector<float> dx(static_cast<size_t>(rows * hidden));
    detail::ExpertGradients grads;
    grads.d_router_weights = d_router_weights.data();
    grads.dx = dx.data();
    if (wants_weight_gradients(owner_args)) {
      const bool accumulate = owner_args.accumulate_weight_grads;
      grads.d_w_gate = detail::weight_grad_out(owner_args.d_w_gate, expert, accumulate);
      grads.d_w_up = detail::weight_grad_out(owner_args.d_w_up, expert, accumulate);
      grads.d_w_down = detail::weight_grad_out(owner_args.d_w_down, expert, accumulate);
    }
    detail::expert_backward(pool, weights, x_rows.data(), d_out_rows.data(), row_weights.data(),
                            rows, shape.swiglu_limit, grads);

    // Push to the source ranks: one writer per slot.
    pool.parallel_for(rows, [&](int64_t row) {
      const PairCoord pair = schedule.pair_of_row(begin + row);
      const int64_t slot = pair.token * top_k + pair.k;
      SourceSlots& source = sources[pair.src_rank];
      source.d_router_weights[slot] = d_router_weights[row];
      bf16* dx_slot = source.dx.data() + slot * hidden;
      for (int64_t n = 0; n < hidden; ++n) dx_slot[n] = float_to_bf16(dx[row * hidden + n]);
    });
  }
}

// Shared expert backward over all tokens of one rank: writes its weight gradients and returns
// its dx rows [T, H] (bf16 values as fp32).
std::vector<float> shared_expert_backward(ThreadPool& pool, const MoeShape& shape, bool fp8,
                                          const BackwardArgs& args) {
  const int64_t tokens = shape.num_tokens, hidden = shape.hidden;
  const int64_t inter = shape.shared_intermediate;
  const ForwardArgs& forward = args.forward;
  std::vector<float> x_rows(static_cast<size_t>(tokens * hidden));
  std::vector<float> d_out_rows(static_cast<size_t>(tokens * hidden));
  convert_bf16_to_float(pool, forward.x.data_as<const bf16>(), tokens * hidden, x_rows.data());
  convert_bf16_to_float(pool, args.d_out.data_as<const bf16>(), tokens * hidden, d_out_rows.data());
  ExpertWeights weights;
  weights.hidden = hidden;
  weights.intermediate = inter;
  if (tokens > 0)
    detail::load_expert_weights(pool, detail::shared_matrices(forward), hidden, inter,
                                detail::WeightsFor::kBackward, fp8, weights);

  std::vector<float> dx(static_cast<size_t>(tokens * hidden));
  detail::ExpertGradients grads;
  grads.dx = dx.data();
  if (wants_weight_gradients(args)) {
    const bool accumulate = args.accumulate_weight_grads;
    grads.d_w_gate = detail::weight_grad_out(args.d_w_shared_gate, 0, accumulate);
    grads.d_w_up = detail::weight_grad_out(args.d_w_shared_up, 0, accumulate);
    grads.d_w_down = detail::weight_grad_out(args.d_w_shared_down, 0, accumulate);
  }
  detail::expert_backward(pool, weights, x_rows.data(), d_out_rows.data(), nullptr, tokens,
                          shape.swiglu_limit, grads);
  return dx;
}

// The source rank's epilogue: d_x[t] = bf16(dx_shared + dx_0 + ... + dx_{K-1}), routed slots
// only, in that order.
void sum_dx_at_source(ThreadPool& pool, const MoeShape& shape, const BackwardArgs& args,
                      const std::vector<float>& shared_dx, const std::vector<bf16>& dx_slots) {
  const int64_t hidden = shape.hidden, top_k = shape.top_k;
  bf16* d_x = args.d_x.data_as<bf16>();
  pool.parallel_for(shape.num_tokens, [&](int64_t token) {
    for (int64_t n = 0; n < hidden; ++n) {
      float acc = shared_dx.empty() ? 0.0f : shared_dx[token * hidden + n];
      for (int64_t k = 0; k < top_k; ++k) {
        if (read_expert_id(args.forward.top_experts, token * top_k + k) < 0) continue;
        acc += bf16_to_float(dx_slots[(token * top_k + k) * hidden + n]);
      }
      d_x[token * hidden + n] = float_to_bf16(acc);
    }
  });
}

}  // namespace

void backward_ep(const MoeShape& shape, const std::vector<BackwardArgs>& rank_args,
                 const Options& options) {
  detail::validate_backward_ranks("backward_ep", shape, rank_args, options.precision);
  const bool fp8 = options.precision == Precision::kFP8Block;
  if (fp8) detail::check_fp8_shape("backward_ep", shape);
  ThreadPool pool(resolve_num_threads(options.num_threads));
  const int32_t num_ranks = shape.num_ranks;
  const int64_t slots_per_rank = shape.num_tokens * shape.top_k;

  std::vector<const ForwardArgs*> rank_ptrs;
  for (const BackwardArgs& args : rank_args) rank_ptrs.push_back(&args.forward);
  const std::vector<int64_t> routing = detail::gather_routing(shape, rank_ptrs);

  std::vector<SourceSlots> sources(num_ranks);
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    sources[rank].dx.resize(static_cast<size_t>(slots_per_rank * shape.hidden));
    // Slots with no route get 0; the owners overwrite every routed slot.
    sources[rank].d_router_weights = rank_args[rank].d_router_weights.data_as<float>();
    std::fill(sources[rank].d_router_weights, sources[rank].d_router_weights + slots_per_rank,
              0.0f);
  }

  for (int32_t owner = 0; owner < num_ranks; ++owner) {
    const OwnerSchedule schedule(shape, routing, owner);
    run_owner_experts(pool, shape, fp8, rank_args[owner], schedule, rank_args, sources);
  }
  for (int32_t source = 0; source < num_ranks; ++source) {
    std::vector<float> shared_dx;
    if (shape.has_shared_expert())
      shared_dx = shared_expert_backward(pool, shape, fp8, rank_args[source]);
    sum_dx_at_source(pool, shape, rank_args[source], shared_dx, sources[source].dx);
    sources[source].dx = {};
  }
}

void backward(const MoeShape& shape, const BackwardArgs& args, const Options& options) {
  detail::require_single_rank("backward", shape);
  backward_ep(shape, std::vector<BackwardArgs>{args}, options);
}

}  // namespace mok::reference
