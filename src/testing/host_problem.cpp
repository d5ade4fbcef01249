// HostProblem: construction with deterministic random values, views, R = 1 equivalents,
// poisoning, and conversion to oracle inputs. See include/mok/host_problem.h.
#include "mok/testing/host_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>

#include "mok/error.h"

namespace mok {

namespace {

// Independent streams per tensor and rank, so one tensor's values do not depend on how many
// values another consumed.
enum class Stream : uint64_t {
  kX = 1,
  kDOut,
  kRouterWeights,
  kWGate,
  kWUp,
  kWDown,
  kWSharedGate,
  kWSharedUp,
  kWSharedDown,
};

SplitMix64 stream(uint64_t seed, Stream tensor, int64_t rank) {
  SplitMix64 mixer(seed ^ (static_cast<uint64_t>(tensor) * 0xd1b54a32d192ed03ull) ^
                   (static_cast<uint64_t>(rank + 1) * 0x8cb92ba72f3d8dd7ull));
  return SplitMix64(mixer.next());
}

// `count` values U(-scale, scale), rounded to bf16. Blocks of kBlockValues values each draw from
// their own stream (derived from `rng` and the block index), so the blocks fill in parallel and
// the values do not depend on the number of threads: the `dsv3` weights of two ranks are 11 G
// values, minutes on one core.
std::vector<bf16> uniform_bf16(SplitMix64 rng, int64_t count, double scale) {
  constexpr int64_t kBlockValues = int64_t{1} << 20;
  std::vector<bf16> values(static_cast<size_t>(count));
  const int64_t blocks = (count + kBlockValues - 1) / kBlockValues;
  auto fill_block = [&](int64_t block) {
    SplitMix64 block_rng(rng.state ^ (static_cast<uint64_t>(block + 1) * 0x9fb21c651e98df25ull));
    block_rng = SplitMix64(block_rng.next());
    const int64_t end = std::min(count, (block + 1) * kBlockValues);
    for (int64_t i = block * kBlockValues; i < end; ++i)
      values[i] = float_to_bf16(static_cast<float>((2.0 * block_rng.uniform() - 1.0) * scale));
  };
  const int64_t workers =
      std::min<int64_t>(blocks, std::max(1u, std::min(64u, std::thread::hardware_concurrency())));
  if (workers <= 1) {
    for (int64_t block = 0; block < blocks; ++block) fill_block(block);
    return values;
  }
  std::vector<std::thread> threads;
  for (int64_t worker = 0; worker < workers; ++worker)
    threads.emplace_back([&, worker] {
      for (int64_t block = worker; block < blocks; block += workers) fill_block(block);
    });
  for (std::thread& thread : threads) thread.join();
  return values;
}

template <typename T>
void append(std::vector<T>& dst, const std::vector<T>& src) {
  dst.insert(dst.end(), src.begin(), src.end());
}

// R = 1 problem holding the tokens of `token_ranks` (concatenated in that order) and every
// expert of the group.
HostProblem merge_ranks(const HostProblem& problem, const std::vector<int32_t>& token_ranks) {
  HostProblem merged;
  merged.shape = problem.shape;
  merged.shape.num_ranks = 1;
  merged.shape.num_tokens = problem.shape.num_tokens * static_cast<int64_t>(token_ranks.size());
  HostRank single;
  for (int32_t rank : token_ranks) {
    const HostRank& source = problem.ranks[rank];
    append(single.x, source.x);
    append(single.d_out, source.d_out);
    append(single.top_experts, source.top_experts);
    append(single.router_weights, source.router_weights);
  }
  for (const HostRank& source : problem.ranks) {
    append(single.w_gate, source.w_gate);
    append(single.w_up, source.w_up);
    append(single.w_down, source.w_down);
  }
  single.w_shared_gate = problem.ranks[0].w_shared_gate;
  single.w_shared_up = problem.ranks[0].w_shared_up;
  single.w_shared_down = problem.ranks[0].w_shared_down;
  allocate_outputs(merged.shape, single);
  merged.ranks.push_back(std::move(single));
  return merged;
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& values) {
  std::vector<double> result(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      result[i] = bf16_to_float(values[i]);
    else
      result[i] = static_cast<double>(values[i]);
  }
  return result;
}

void check_rank(const HostProblem& problem, int32_t rank) {
  if (rank < 0 || rank >= static_cast<int32_t>(problem.ranks.size()))
    throw Error(ErrorCode::kInvalidArgument, "HostProblem: rank = " + std::to_string(rank) +
                                                 "; valid: [0, " +
                                                 std::to_string(problem.ranks.size()) + ")");
}

}  // namespace

void allocate_outputs(const MoeShape& shape, HostRank& rank) {
  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t K = shape.top_k, E = shape.num_local_experts(), Is = shape.shared_intermediate;
  rank.out.assign(T * H, bf16{});
  rank.d_x.assign(T * H, bf16{});
  rank.d_router_weights.assign(T * K, 0.0f);
  rank.d_w_gate.assign(E * I * H, bf16{});
  rank.d_w_up.assign(E * I * H, bf16{});
  rank.d_w_down.assign(E * H * I, bf16{});
  rank.d_w_shared_gate.assign(Is * H, bf16{});
  rank.d_w_shared_up.assign(Is * H, bf16{});
  rank.d_w_shared_down.assign(H * Is, bf16{});
}

HostRank output_buffers(const MoeShape& shape) {
  HostRank rank;
  allocate_outputs(shape, rank);
  return rank;
}

bool outputs_equal(const HostRank& a, const HostRank& b) {
  bool equal = true;
  for_each_output_field([&](const char*, auto member) {
    const auto &x = a.*member, &y = b.*member;
    equal &= x.size() == y.size() &&
             (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  });
  return equal;
}

HostProblem HostProblem::make(const MoeShape& shape, RoutingKind routing, uint64_t seed) {
  can_implement(shape).throw_if_error();
  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t K = shape.top_k, E = shape.num_local_experts(), Is = shape.shared_intermediate;
  const int32_t R = shape.num_ranks;

  HostProblem problem;
  problem.shape = shape;
  problem.ranks.resize(R);
  const std::vector<int32_t> all_routing =
      generate_routing(routing, R, static_cast<int32_t>(T), shape.top_k,
                       static_cast<int32_t>(shape.num_experts), seed);
  // Replicated shared expert: one stream, copied to every rank.
  const std::vector<bf16> shared_gate =
      uniform_bf16(stream(seed, Stream::kWSharedGate, 0), Is * H, 1.0 / std::sqrt(double(H)));
  const std::vector<bf16> shared_up =
      uniform_bf16(stream(seed, Stream::kWSharedUp, 0), Is * H, 1.0 / std::sqrt(double(H)));
  const std::vector<bf16> shared_down = uniform_bf16(stream(seed, Stream::kWSharedDown, 0), H * Is,
                                                     Is > 0 ? 1.0 / std::sqrt(double(Is)) : 0.0);

  for (int32_t r = 0; r < R; ++r) {
    HostRank& rank = problem.ranks[r];
    rank.x = uniform_bf16(stream(seed, Stream::kX, r), T * H, 1.0);
    rank.d_out = uniform_bf16(stream(seed, Stream::kDOut, r), T * H, 1.0);
    rank.top_experts.assign(all_routing.begin() + r * T * K, all_routing.begin() + (r + 1) * T * K);
    SplitMix64 weight_rng = stream(seed, Stream::kRouterWeights, r);
    rank.router_weights.resize(T * K);
    for (float& weight : rank.router_weights) weight = static_cast<float>(weight_rng.uniform());
    rank.w_gate =
        uniform_bf16(stream(seed, Stream::kWGate, r), E * I * H, 1.0 / std::sqrt(double(H)));
    rank.w_up = uniform_bf16(stream(seed, Stream::kWUp, r), E * I * H, 1.0 / std::sqrt(double(H)));
    rank.w_down =
        uniform_bf16(stream(seed, Stream::kWDown, r), E * H * I, 1.0 / std::sqrt(double(I)));
    rank.w_shared_gate = shared_gate;
    rank.w_shared_up = shared_up;
    rank.w_shared_down = shared_down;
    allocate_outputs(shape, rank);
  }
  return problem;
}

int64_t HostProblem::bytes_needed(const MoeShape& shape) {
  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t K = shape.top_k, E = shape.num_local_experts(), Is = shape.shared_intermediate;
  constexpr int64_t kBf16 = 2, kF32 = 4, kI32 = 4;
  // Inputs and outputs have the same extents (x/out, d_out/d_x, weights/gradients).
  const int64_t activations = 2 * T * H * kBf16;                 // x, d_out
  const int64_t routing = T * K * (kI32 + kF32);                 // top_experts, router weights
  const int64_t weights = (3 * E * I * H + 3 * Is * H) * kBf16;  // routed + shared
  const int64_t per_rank = 2 * (activations + weights) + routing + T * K * kF32;
  // make() also holds the routing of all ranks while it splits it.
  return shape.num_ranks * (per_rank + T * K * kI32);
}

// Pointers to every tensor of a rank.
static LayerPointers pointers_of(HostRank& rank) {
  LayerPointers p;
  p.x = rank.x.data();
  p.top_experts = rank.top_experts.data();
  p.router_weights = rank.router_weights.data();
  p.w_gate = rank.w_gate.data();
  p.w_up = rank.w_up.data();
  p.w_down = rank.w_down.data();
  p.w_shared_gate = rank.w_shared_gate.data();
  p.w_shared_up = rank.w_shared_up.data();
  p.w_shared_down = rank.w_shared_down.data();
  p.out = rank.out.data();
  p.d_out = rank.d_out.data();
  p.d_x = rank.d_x.data();
  p.d_router_weights = rank.d_router_weights.data();
  p.d_w_gate = rank.d_w_gate.data();
  p.d_w_up = rank.d_w_up.data();
  p.d_w_down = rank.d_w_down.data();
  p.d_w_shared_gate = rank.d_w_shared_gate.data();
  p.d_w_shared_up = rank.d_w_shared_up.data();
  p.d_w_shared_down = rank.d_w_shared_down.data();
  return p;
}

ForwardArgs HostProblem::forward_args(int32_t rank_index) {
  check_rank(*this, rank_index);
  return make_forward_args(shape, pointers_of(ranks[rank_index]), DeviceType::kCPU);
}

BackwardArgs HostProblem::backward_args(int32_t rank_index) {
  check_rank(*this, rank_index);
  return make_backward_args(shape, pointers_of(ranks[rank_index]), DeviceType::kCPU);
}

HostFp8Weights HostFp8Weights::quantize(const MoeShape& shape, const HostRank& rank) {
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const int64_t E = shape.num_local_experts();
  struct Matrix {
    const std::vector<bf16>* values;
    int64_t count, rows, cols;
  };
  const Matrix matrices[kCount] = {{&rank.w_gate, E, I, H},       {&rank.w_up, E, I, H},
                                   {&rank.w_down, E, H, I},       {&rank.w_shared_gate, 1, Is, H},
                                   {&rank.w_shared_up, 1, Is, H}, {&rank.w_shared_down, 1, H, Is}};
  HostFp8Weights out;
  for (int i = 0; i < kCount; ++i) {
    const Matrix& m = matrices[i];
    if (m.values->empty()) continue;
    const int64_t values = m.rows * m.cols, blocks = values / (kFp8GroupSize * kFp8GroupSize);
    out.codes[i].resize(static_cast<size_t>(m.count * values));
    out.scales[i].resize(static_cast<size_t>(m.count * blocks));
    for (int64_t e = 0; e < m.count; ++e)
      quantize_fp8_blocks(m.values->data() + e * values, m.rows, m.cols,
                          out.codes[i].data() + e * values, out.scales[i].data() + e * blocks);
  }
  return out;
}

void give_fp8_weights(const MoeShape& shape, ForwardArgs& args,
                      const void* const codes[HostFp8Weights::kCount],
                      const float* const scales[HostFp8Weights::kCount], unsigned which) {
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const int64_t E = shape.num_local_experts(), B = kFp8GroupSize;
  struct Target {
    TensorView* values;
    Fp8BlockWeight* fp8;
    std::vector<int64_t> dims;
  };
  const Target targets[HostFp8Weights::kCount] = {
      {&args.w_gate, &args.w_gate_fp8, {E, I, H}},
      {&args.w_up, &args.w_up_fp8, {E, I, H}},
      {&args.w_down, &args.w_down_fp8, {E, H, I}},
      {&args.w_shared_gate, &args.w_shared_gate_fp8, {Is, H}},
      {&args.w_shared_up, &args.w_shared_up_fp8, {Is, H}},
      {&args.w_shared_down, &args.w_shared_down_fp8, {H, Is}}};
  for (int i = 0; i < HostFp8Weights::kCount; ++i) {
    if ((which >> i & 1u) == 0 || (i >= 3 && !shape.has_shared_expert())) continue;
    const Target& t = targets[i];
    std::vector<int64_t> block_dims = t.dims;
    block_dims[block_dims.size() - 1] /= B;
    block_dims[block_dims.size() - 2] /= B;
    auto view = [&](const void* data, DType dtype, const std::vector<int64_t>& dims) {
      return TensorView::contiguous(const_cast<void*>(data), dtype, dims, args.x.device_type,
                                    args.x.device_id);
    };
    t.fp8->codes = view(codes[i], DType::kFloat8E4M3, t.dims);
    t.fp8->scales = view(scales[i], DType::kFloat32, block_dims);
    *t.values = TensorView{};
  }
}

void give_fp8_weights(const MoeShape& shape, ForwardArgs& args, const HostFp8Weights& weights,
                      unsigned which) {
  const void* codes[HostFp8Weights::kCount];
  const float* scales[HostFp8Weights::kCount];
  for (int i = 0; i < HostFp8Weights::kCount; ++i) {
    codes[i] = weights.codes[i].data();
    scales[i] = weights.scales[i].data();
  }
  give_fp8_weights(shape, args, codes, scales, which);
}

std::vector<e4m3> fused_gate_up_codes(const MoeShape& shape, const HostFp8Weights& weights) {
  const int64_t E = shape.num_local_experts(), matrix = shape.intermediate * shape.hidden;
  std::vector<e4m3> fused(static_cast<size_t>(2 * E * matrix));
  for (int64_t e = 0; e < E; ++e)
    for (int half = 0; half < 2; ++half)
      std::copy_n(weights.codes[half].begin() + e * matrix, matrix,
                  fused.begin() + (2 * e + half) * matrix);
  return fused;
}

void give_fused_gate_up_codes(const MoeShape& shape, ForwardArgs& args, const void* fused) {
  const int64_t E = shape.num_local_experts(), I = shape.intermediate, H = shape.hidden;
  TensorView* halves[2] = {&args.w_gate_fp8.codes, &args.w_up_fp8.codes};
  for (int half = 0; half < 2; ++half) {
    TensorView view = TensorView::contiguous(
        const_cast<uint8_t*>(static_cast<const uint8_t*>(fused)) + half * I * H, DType::kFloat8E4M3,
        {E, I, H}, args.x.device_type, args.x.device_id);
    view.strides[0] = 2 * I * H;
    *halves[half] = view;
  }
}

std::vector<ForwardArgs> HostProblem::all_forward_args() {
  std::vector<ForwardArgs> args;
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) args.push_back(forward_args(rank));
  return args;
}

std::vector<BackwardArgs> HostProblem::all_backward_args() {
  std::vector<BackwardArgs> args;
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) args.push_back(backward_args(rank));
  return args;
}

HostProblem HostProblem::token_slice(const std::vector<int64_t>& tokens) const {
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kInvalidArgument,
                "HostProblem::token_slice: num_ranks = " + std::to_string(shape.num_ranks) +
                    "; valid: 1 (use single_rank_equivalent() first)");
  for (int64_t token : tokens)
    if (token < 0 || token >= shape.num_tokens)
      throw Error(ErrorCode::kInvalidArgument,
                  "HostProblem::token_slice: token " + std::to_string(token) +
                      " is out of range; valid: [0, " + std::to_string(shape.num_tokens) + ")");
  HostProblem slice;
  slice.shape = shape;
  slice.shape.num_tokens = static_cast<int64_t>(tokens.size());
  const HostRank& full = ranks[0];
  HostRank rank;
  const int64_t H = shape.hidden, K = shape.top_k;
  for (int64_t token : tokens) {
    rank.x.insert(rank.x.end(), full.x.begin() + token * H, full.x.begin() + (token + 1) * H);
    rank.d_out.insert(rank.d_out.end(), full.d_out.begin() + token * H,
                      full.d_out.begin() + (token + 1) * H);
    rank.top_experts.insert(rank.top_experts.end(), full.top_experts.begin() + token * K,
                            full.top_experts.begin() + (token + 1) * K);
    rank.router_weights.insert(rank.router_weights.end(), full.router_weights.begin() + token * K,
                               full.router_weights.begin() + (token + 1) * K);
  }
  rank.w_gate = full.w_gate;
  rank.w_up = full.w_up;
  rank.w_down = full.w_down;
  rank.w_shared_gate = full.w_shared_gate;
  rank.w_shared_up = full.w_shared_up;
  rank.w_shared_down = full.w_shared_down;
  allocate_outputs(slice.shape, rank);
  slice.ranks.push_back(std::move(rank));
  return slice;
}

HostProblem HostProblem::reference_slice(const std::vector<int64_t>& group_tokens) const {
  const int64_t T = shape.num_tokens, H = shape.hidden, K = shape.top_k;
  const int64_t I = shape.intermediate, E = shape.num_experts, E_loc = shape.num_local_experts();
  for (int64_t token : group_tokens)
    if (token < 0 || token >= T * shape.num_ranks)
      throw Error(ErrorCode::kInvalidArgument,
                  "HostProblem::reference_slice: token " + std::to_string(token) +
                      " is out of range; valid: [0, " + std::to_string(T * shape.num_ranks) +
                      ") (rank * num_tokens + token)");
  // The experts the slice routes to, in id order; the slice numbers them 0, 1, ...
  std::vector<int32_t> compact(static_cast<size_t>(E), -1);
  std::vector<int32_t> used;
  for (int64_t token : group_tokens) {
    const HostRank& source = ranks[token / T];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t expert = source.top_experts[(token % T) * K + k];
      if (expert >= 0 && expert < E && compact[expert] < 0) {
        compact[expert] = 0;
        used.push_back(expert);
      }
    }
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 0; i < used.size(); ++i) compact[used[i]] = static_cast<int32_t>(i);
  HostProblem slice;
  slice.shape = shape;
  slice.shape.num_ranks = 1;
  slice.shape.num_tokens = static_cast<int64_t>(group_tokens.size());
  // At least one expert (a slice of unrouted tokens); the extra experts stay unused.
  slice.shape.num_experts = std::max<int64_t>(1, static_cast<int64_t>(used.size()));
  HostRank rank;
  for (int64_t token : group_tokens) {
    const HostRank& source = ranks[token / T];
    const int64_t t = token % T;
    rank.x.insert(rank.x.end(), source.x.begin() + t * H, source.x.begin() + (t + 1) * H);
    rank.d_out.insert(rank.d_out.end(), source.d_out.begin() + t * H,
                      source.d_out.begin() + (t + 1) * H);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t expert = source.top_experts[t * K + k];
      // Ids outside [0, E) stay outside the slice's range: -1 stays -1, others become E'.
      rank.top_experts.push_back(expert < 0   ? expert
                                 : expert < E ? compact[expert]
                                              : static_cast<int32_t>(slice.shape.num_experts));
      rank.router_weights.push_back(source.router_weights[t * K + k]);
    }
  }
  const int64_t per_expert = I * H;
  rank.w_gate.assign(slice.shape.num_experts * per_expert, bf16{});
  rank.w_up.assign(slice.shape.num_experts * per_expert, bf16{});
  rank.w_down.assign(slice.shape.num_experts * per_expert, bf16{});
  for (size_t i = 0; i < used.size(); ++i) {
    const HostRank& owner = ranks[used[i] / E_loc];
    const int64_t from = (used[i] % E_loc) * per_expert, to = static_cast<int64_t>(i) * per_expert;
    std::copy_n(owner.w_gate.begin() + from, per_expert, rank.w_gate.begin() + to);
    std::copy_n(owner.w_up.begin() + from, per_expert, rank.w_up.begin() + to);
    std::copy_n(owner.w_down.begin() + from, per_expert, rank.w_down.begin() + to);
  }
  rank.w_shared_gate = ranks[0].w_shared_gate;
  rank.w_shared_up = ranks[0].w_shared_up;
  rank.w_shared_down = ranks[0].w_shared_down;
  allocate_outputs(slice.shape, rank);
  slice.ranks.push_back(std::move(rank));
  return slice;
}

HostProblem HostProblem::single_rank_equivalent() const {
  std::vector<int32_t> all_ranks;
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank) all_ranks.push_back(rank);
  return merge_ranks(*this, all_ranks);
}

HostProblem HostProblem::rank_alone(int32_t rank) const {
  check_rank(*this, rank);
  return merge_ranks(*this, {rank});
}

void HostProblem::poison_outputs() {
  bf16 poison_bf16;
  poison_bf16.bits = kPoisonBf16Bits;
  float poison_f32;
  std::memcpy(&poison_f32, &kPoisonF32Bits, sizeof(poison_f32));
  for (HostRank& rank : ranks)
    for_each_output_field([&](const char*, auto member) {
      auto& buffer = rank.*member;
      if constexpr (std::is_same_v<typename std::decay_t<decltype(buffer)>::value_type, float>)
        std::fill(buffer.begin(), buffer.end(), poison_f32);
      else
        std::fill(buffer.begin(), buffer.end(), poison_bf16);
    });
}

oracle::Inputs HostProblem::to_oracle_inputs() const {
  if (shape.num_ranks != 1)
    throw Error(
        ErrorCode::kInvalidArgument,
        "HostProblem::to_oracle_inputs: shape.num_ranks = " + std::to_string(shape.num_ranks) +
            "; the oracle is single-rank (use single_rank_equivalent() first)");
  const HostRank& rank = ranks[0];
  oracle::Inputs inputs;
  inputs.x = to_double(rank.x);
  inputs.top_experts.assign(rank.top_experts.begin(), rank.top_experts.end());
  inputs.router_weights = to_double(rank.router_weights);
  inputs.w_gate = to_double(rank.w_gate);
  inputs.w_up = to_double(rank.w_up);
  inputs.w_down = to_double(rank.w_down);
  inputs.w_shared_gate = to_double(rank.w_shared_gate);
  inputs.w_shared_up = to_double(rank.w_shared_up);
  inputs.w_shared_down = to_double(rank.w_shared_down);
  inputs.d_out = to_double(rank.d_out);
  return inputs;
}

}  // namespace mok
