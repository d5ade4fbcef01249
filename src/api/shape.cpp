// MoeShape and MoeConfig checks, and the named shapes of DESIGN.md.
#include "mok/shape.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "mok/config.h"
#include "mok/fp8.h"
#include "mok/schedule.h"

namespace mok {

namespace {

std::string field_error(const char* field, int64_t value, const std::string& valid) {
  return std::string("shape: ") + field + " = " + std::to_string(value) + "; valid: " + valid;
}

Status check_dim(const char* field, int64_t value, bool allow_zero) {
  if ((allow_zero && value == 0)) return Status::Ok();
  if (value < kDimAlignment || value > kMaxDim || value % kDimAlignment != 0)
    return Status::invalid(field_error(field, value,
                                       std::string(allow_zero ? "0 (none) or " : "") +
                                           "a multiple of " + std::to_string(kDimAlignment) +
                                           " in [" + std::to_string(kDimAlignment) + ", " +
                                           std::to_string(kMaxDim) + "]"));
  return Status::Ok();
}

}  // namespace

std::string MoeShape::to_string() const {
  std::ostringstream text;
  text << "T=" << num_tokens << " H=" << hidden << " I=" << intermediate << " E=" << num_experts
       << " K=" << top_k << " R=" << num_ranks;
  if (has_shared_expert()) text << " Is=" << shared_intermediate;
  if (has_clamp()) text << " L=" << swiglu_limit;
  return text.str();
}

Status can_implement(const MoeShape& shape) {
  if (shape.num_tokens < 0 || shape.num_tokens > kMaxTokensPerRank)
    return Status::invalid(field_error("num_tokens", shape.num_tokens,
                                       "[0, " + std::to_string(kMaxTokensPerRank) + "]"));
  MOK_RETURN_IF_ERROR(check_dim("hidden", shape.hidden, false));
  MOK_RETURN_IF_ERROR(check_dim("intermediate", shape.intermediate, false));
  MOK_RETURN_IF_ERROR(check_dim("shared_intermediate", shape.shared_intermediate, true));
  if (shape.top_k < 1 || shape.top_k > kMaxTopK)
    return Status::invalid(
        field_error("top_k", shape.top_k, "[1, " + std::to_string(kMaxTopK) + "]"));
  if (shape.num_ranks < 1 || shape.num_ranks > kMaxRanks)
    return Status::invalid(
        field_error("num_ranks", shape.num_ranks, "[1, " + std::to_string(kMaxRanks) + "]"));
  if (shape.num_experts < 1 || shape.num_experts > kMaxExperts)
    return Status::invalid(
        field_error("num_experts", shape.num_experts, "[1, " + std::to_string(kMaxExperts) + "]"));
  if (shape.num_experts % shape.num_ranks != 0)
    return Status::invalid(
        field_error("num_experts", shape.num_experts,
                    "a multiple of num_ranks = " + std::to_string(shape.num_ranks) +
                        " (every rank owns E/R experts)"));
  if (!(shape.swiglu_limit > 0.0f))
    return Status::invalid("shape: swiglu_limit = " + std::to_string(shape.swiglu_limit) +
                           "; valid: a positive number, or infinity for no clamp");
  MOK_RETURN_IF_ERROR(validate_schedule_params(schedule_params(shape)));
  return Status::Ok();
}

ScheduleParams schedule_params(const MoeShape& shape, int32_t local_rank) {
  ScheduleParams params;
  params.num_ranks = shape.num_ranks;
  params.tokens_per_rank = static_cast<int32_t>(shape.num_tokens);
  params.top_k = shape.top_k;
  params.num_experts = static_cast<int32_t>(shape.num_experts);
  params.local_rank = local_rank;
  return params;
}

MoeShape named_shape(std::string_view name, int32_t num_ranks) {
  MoeShape shape;
  shape.num_ranks = num_ranks;
  shape.top_k = 8;
  if (name == "dsv3" || name == "dsv3_local" || name == "dsv3_e128" || name == "kimi_slice") {
    shape.hidden = 7168;
    shape.intermediate = 2048;
    shape.num_tokens = name == "kimi_slice" ? 2048 : 4096;
    shape.num_experts = name == "dsv3"         ? 256
                        : name == "dsv3_local" ? 32
                        : name == "dsv3_e128"  ? 128  // one GPU's experts of dsv3 at EP = 2
                                               : 8 * num_ranks;
  } else if (name == "sonic_e128") {  // SonicMoE's own 120B-class point
    shape.hidden = 4096;
    shape.intermediate = 1024;
    shape.num_experts = 128;
    shape.num_tokens = 32768;
  } else if (name == "qwen3") {
    shape.hidden = 2048;
    shape.intermediate = 768;
    shape.num_experts = 128;
    shape.num_tokens = 8192;
  } else if (name == "tiny") {
    shape.hidden = 256;
    shape.intermediate = 128;
    shape.num_experts = 8;
    shape.top_k = 2;
    shape.num_tokens = 64;
  } else {
    std::string valid;
    for (const auto& known : named_shape_names()) valid += (valid.empty() ? "" : ", ") + known;
    throw Error(ErrorCode::kInvalidArgument,
                "shape name '" + std::string(name) + "' is unknown; valid: " + valid);
  }
  return shape;
}

std::vector<std::string> named_shape_names() {
  return {"tiny", "qwen3", "dsv3", "dsv3_local", "dsv3_e128", "sonic_e128", "kimi_slice"};
}

int64_t weight_bytes_per_rank(const MoeShape& shape) {
  const int64_t routed = 3 * shape.num_local_experts() * shape.intermediate * shape.hidden;
  const int64_t shared = 3 * shape.shared_intermediate * shape.hidden;
  return (routed + shared) * static_cast<int64_t>(sizeof(uint16_t));
}

Status can_implement(const MoeConfig& config, const MoeShape& shape) {
  MOK_RETURN_IF_ERROR(can_implement(shape));
  if (config.precision == Precision::kFP8Block) {
    // The FP8 path (src/layer/fp8_stages.cpp): the kernel sequences, one macrobatch; on one GPU
    // or, with the rows the expert-parallel exchange delivers in bf16, on every rank of a group.
    auto fp8_unsupported = [](const std::string& what) {
      return Status::unsupported("config: precision = fp8_block " + what);
    };
    for (auto [field, value] :
         {std::pair{"hidden", shape.hidden}, std::pair{"intermediate", shape.intermediate},
          std::pair{"shared_intermediate", shape.shared_intermediate}})
      if (value % 128 != 0)
        return fp8_unsupported(std::string("needs ") + field +
                               " a multiple of 128 (its groups "
                               "and blocks); got " +
                               std::to_string(value));
    for (auto [field, value] :
         {std::pair{"hidden", shape.hidden}, std::pair{"2 * intermediate", 2 * shape.intermediate},
          std::pair{"2 * shared_intermediate", 2 * shape.shared_intermediate}})
      if (value > kFp8MaxReduction)
        return fp8_unsupported(std::string("needs ") + field + " (a GEMM's reduction) at most " +
                               std::to_string(kFp8MaxReduction) + "; got " + std::to_string(value));
    if (config.persistent_forward || config.persistent_backward)
      return fp8_unsupported(
          "runs the kernel sequences; valid: persistent_forward and "
          "persistent_backward false");
    const int64_t max_rows = schedule_params(shape).max_rows();
    const bool one_macrobatch =
        config.macrobatch_size == kAutoMacrobatch
            ? max_rows * macrobatch_ring_bytes_per_row(shape) <= kAutoMacrobatchRingBytes
            : config.macrobatch_size >= max_rows;
    if (!one_macrobatch)
      return fp8_unsupported(
          "holds one macrobatch; macrobatch_size = " + std::to_string(config.macrobatch_size) +
          " cuts the " + std::to_string(max_rows) +
          " worst-case rows; valid: 0 or >= " + std::to_string(max_rows));
    if (shape.has_shared_expert() && shape.num_tokens % 128 != 0)
      return fp8_unsupported("with a shared expert needs num_tokens a multiple of 128; got " +
                             std::to_string(shape.num_tokens));
  } else if (config.precision != Precision::kBF16) {
    return Status::unsupported(std::string("config: precision = ") +
                               std::to_string(static_cast<int32_t>(config.precision)) +
                               "; valid: bf16, fp8_block");
  }
  if (config.gemm_wide_tiles && shape.num_local_experts() > kMaxWideTileExperts)
    return Status::unsupported(
        "config: gemm_wide_tiles = true with " + std::to_string(shape.num_local_experts()) +
        " local experts; valid: at most " + std::to_string(kMaxWideTileExperts));
  return can_implement_knobs(config, shape.num_ranks);
}

Status can_implement_knobs(const MoeConfig& config, int32_t num_ranks) {
  auto bad = [](const std::string& text) { return Status::invalid("config: " + text); };
  for (auto [field, value] : {std::pair{"fwd_num_comm_sms", config.fwd_num_comm_sms},
                              std::pair{"bwd_num_comm_sms", config.bwd_num_comm_sms}}) {
    const int32_t low = num_ranks > 1 ? 1 : 0;
    if (value < low || value > kMaxCommSms)
      return bad(std::string(field) + " = " + std::to_string(value) + "; valid: [" +
                 std::to_string(low) + ", " + std::to_string(kMaxCommSms) + "]" +
                 (num_ranks > 1 ? " (at least 1 with more than one rank)" : ""));
  }
  if (config.minibatch_size != kAutoMinibatch &&
      (config.minibatch_size < kDefaultRowAlign || config.minibatch_size % kDefaultRowAlign != 0))
    return bad("minibatch_size = " + std::to_string(config.minibatch_size) +
               "; valid: 0 (sized from the shape) or a positive multiple of " +
               std::to_string(kDefaultRowAlign) + " (the GEMM tile height)");
  // Under an automatic minibatch the macrobatch only has to be whole row tiles: the minibatch
  // is then chosen to divide it (minibatch_rows).
  const int64_t macrobatch_unit =
      config.minibatch_size == kAutoMinibatch ? kDefaultRowAlign : config.minibatch_size;
  if (config.macrobatch_size != kAutoMacrobatch &&
      (config.macrobatch_size < macrobatch_unit || config.macrobatch_size % macrobatch_unit != 0))
    return bad("macrobatch_size = " + std::to_string(config.macrobatch_size) +
               "; valid: 0 (sized from the shape) or a positive multiple of " +
               (config.minibatch_size == kAutoMinibatch
                    ? std::to_string(kDefaultRowAlign) + " (the GEMM tile height)"
                    : "minibatch_size = " + std::to_string(config.minibatch_size)));
  if (config.gemm_tile_group < 1 || config.gemm_tile_group > kMaxTileGroup)
    return bad("gemm_tile_group = " + std::to_string(config.gemm_tile_group) + "; valid: 1 to " +
               std::to_string(kMaxTileGroup) + " row tiles");
  if (config.gemm_expert_groups < 0 || config.gemm_expert_groups > kMaxTileGroup)
    return bad("gemm_expert_groups = " + std::to_string(config.gemm_expert_groups) +
               "; valid: 0 (fixed groups of 8) or 1 to " + std::to_string(kMaxTileGroup) +
               " row tiles");
  if (config.gemm_lockstep_k_blocks != 0 &&
      (config.gemm_lockstep_k_blocks < 2 || config.gemm_lockstep_k_blocks > kMaxLockstepKBlocks))
    return bad("gemm_lockstep_k_blocks = " + std::to_string(config.gemm_lockstep_k_blocks) +
               "; valid: 0 (off) or 2 to " + std::to_string(kMaxLockstepKBlocks) +
               " (K-blocks a CTA may run ahead of the slowest)");
  if (config.gemm_lockstep_k_blocks != 0 && config.gemm_cta_pairs)
    return bad("gemm_lockstep_k_blocks = " + std::to_string(config.gemm_lockstep_k_blocks) +
               " with gemm_cta_pairs = true; valid: gemm_lockstep_k_blocks = 0 (a CTA pair keeps "
               "its two CTAs in step by itself)");
  if (!(config.wait_timeout_s > 0.0) || !std::isfinite(config.wait_timeout_s))
    return bad("wait_timeout_s = " + std::to_string(config.wait_timeout_s) +
               "; valid: a positive, finite number of seconds");
  if (config.local_dispatch != LocalDispatch::kGatherKernel &&
      config.local_dispatch != LocalDispatch::kProducerWarps)
    return bad("local_dispatch = " + std::to_string(static_cast<int32_t>(config.local_dispatch)) +
               "; valid: 0 (gather-kernel), 1 (producer-warps)");
  if (config.gemm_wide_tiles) {
    const std::string with = "gemm_wide_tiles = true with ";
    if (config.gemm_cta_pairs)
      return bad(with +
                 "gemm_cta_pairs = true; valid: at most one of them (the 256 x 192 tiles "
                 "run without clusters)");
    if (config.persistent_forward || config.persistent_backward)
      return bad(with + (config.persistent_forward ? "persistent_forward" : "persistent_backward") +
                 " = true; valid: persistent_forward and persistent_backward false (the 256 x "
                 "192 tiles are the kernel sequences' GEMMs)");
    if (config.ep_dispatch_in_gemm)
      return bad(with +
                 "ep_dispatch_in_gemm = true; valid: ep_dispatch_in_gemm = false (the pull and "
                 "push inside the GEMMs run in the 128 x 256 tiles only)");
    if (config.precision != Precision::kBF16)
      return bad(with +
                 "precision = fp8_block; valid: precision = bf16 (FP8 has GEMMs of its own)");
  }
  // A variant of the bf16 128 x 256 expert GEMMs without CTA pairs: what excludes it, each named
  // with why.
  auto excluded_variant = [&](const char* knob, const char* pairs_why,
                              const char* wide_why) -> Status {
    const std::string with = std::string(knob) + " = true with ";
    if (config.gemm_cta_pairs)
      return bad(with + "gemm_cta_pairs = true; valid: at most one of them (" + pairs_why + ")");
    if (config.gemm_wide_tiles)
      return bad(with + "gemm_wide_tiles = true; valid: at most one of them (" + wide_why + ")");
    if (config.precision != Precision::kBF16)
      return bad(with +
                 "precision = fp8_block; valid: precision = bf16 (FP8 has GEMMs of its own)");
    return Status::Ok();
  };
  if (config.gemm_l2_placement)
    MOK_RETURN_IF_ERROR(excluded_variant(
        "gemm_l2_placement", "a CTA pair walks its two tiles together, wherever its SMs are",
        "the 256 x 192 tiles walk by block index"));
  if (config.gemm_dgrad_half_row_tiles)
    MOK_RETURN_IF_ERROR(excluded_variant("gemm_dgrad_half_row_tiles",
                                         "a CTA pair's two tiles walk one stage sequence",
                                         "the 256 x 192 tiles' dgrads have no 64-row tiles"));
  if (config.gemm_expert_aligned_groups)
    MOK_RETURN_IF_ERROR(excluded_variant("gemm_expert_aligned_groups",
                                         "a CTA pair's units are pairs of row tiles",
                                         "the 256 x 192 tiles group their own units"));
  if (config.fp8_row_tile_rows != kAutoFp8RowTileRows && config.fp8_row_tile_rows != 128 &&
      config.fp8_row_tile_rows != 192)
    return bad("fp8_row_tile_rows = " + std::to_string(config.fp8_row_tile_rows) +
               "; valid: 0 (automatic), 128 or 192");
  if (config.fp8_row_tile_rows == 192 && config.precision != Precision::kFP8Block)
    return bad(
        "fp8_row_tile_rows = 192 with precision = bf16; valid: fp8_row_tile_rows = 128 "
        "(the 192-row tiles are the FP8 row-tile GEMMs')");
  if (config.fp8_weight_grad_staging_tiles != 1 && config.fp8_weight_grad_staging_tiles != 2)
    return bad("fp8_weight_grad_staging_tiles = " +
               std::to_string(config.fp8_weight_grad_staging_tiles) + "; valid: 1 or 2");
  if (config.fp8_weight_grad_staging_tiles == 2 && config.precision != Precision::kFP8Block)
    return bad(
        "fp8_weight_grad_staging_tiles = 2 with precision = bf16; valid: "
        "fp8_weight_grad_staging_tiles = 1 (the FP8 weight gradients' staging)");
  if (config.fp8_swiglu != Fp8SwigluPlace::kPass &&
      config.fp8_swiglu != Fp8SwigluPlace::kGateUpWithoutContext &&
      config.fp8_swiglu != Fp8SwigluPlace::kGateUp)
    return bad("fp8_swiglu = " + std::to_string(static_cast<int32_t>(config.fp8_swiglu)) +
               "; valid: 0 (pass), 1 (gate-up-without-context), 2 (gate-up)");
  if (config.fp8_row_tile_rows == 192 && config.gemm_expert_groups != 0)
    return bad("fp8_row_tile_rows = 192 with gemm_expert_groups = " +
               std::to_string(config.gemm_expert_groups) +
               "; valid: gemm_expert_groups = 0 (the expert groups walk 128-row tiles)");
  if (config.gemm_expert_groups != 0 && config.precision != Precision::kFP8Block)
    return bad("gemm_expert_groups = " + std::to_string(config.gemm_expert_groups) +
               " with precision = bf16; valid: gemm_expert_groups = 0 (the expert groups walk "
               "the FP8 row-tile GEMMs; the bf16 version, commit f2b2930, awaits a timing of its "
               "default path)");
  if (config.gemm_four_stages)
    MOK_RETURN_IF_ERROR(excluded_variant("gemm_four_stages", "a CTA pair's stages are three",
                                         "the 256 x 192 tiles have their own ring"));
  if (config.gemm_tiles_by_ticket) {
    MOK_RETURN_IF_ERROR(excluded_variant("gemm_tiles_by_ticket",
                                         "a CTA pair walks its two tiles together",
                                         "the 256 x 192 tiles walk statically"));
    const std::string with = "gemm_tiles_by_ticket = true with ";
    if (config.gemm_l2_placement)
      return bad(with +
                 "gemm_l2_placement = true; valid: at most one of them (the placement's "
                 "slots are a static walk)");
    if (config.gemm_lockstep_k_blocks != 0)
      return bad(with +
                 "gemm_lockstep_k_blocks = " + std::to_string(config.gemm_lockstep_k_blocks) +
                 "; valid: gemm_lockstep_k_blocks = 0 (two remedies for the same drift)");
  }
  if (config.ep_dispatch_in_gemm) {
    if (config.ep_push_dispatch)
      return bad(
          "ep_dispatch_in_gemm = true with ep_push_dispatch = true; valid: at most one of "
          "them (the dispatch inside the GEMM is a pull)");
    if (config.local_dispatch != LocalDispatch::kProducerWarps)
      return bad(
          "ep_dispatch_in_gemm = true with local_dispatch = gather-kernel; valid: "
          "local_dispatch = producer-warps (the GEMM's producer warps pull the rows)");
    if (config.precision != Precision::kBF16)
      return bad(
          "ep_dispatch_in_gemm = true with precision = fp8_block; valid: precision = bf16 "
          "(FP8 quantizes the rows as it gathers them, before its GEMM)");
  }
  if (config.swiglu_backward_in_dgrad) {
    const std::string with = "swiglu_backward_in_dgrad = true with ";
    if (config.persistent_backward)
      return bad(with +
                 "persistent_backward = true; valid: at most one of them (the persistent "
                 "backward runs its own SwiGLU task)");
    if (config.precision != Precision::kBF16)
      return bad(with +
                 "precision = fp8_block; valid: precision = bf16 (the FP8 backward's SwiGLU "
                 "quantizes its outputs in its own pass)");
    if (config.gemm_wide_tiles)
      return bad(with +
                 "gemm_wide_tiles = true; valid: at most one of them (the 256 x 192 tiles have "
                 "no such epilogue)");
    if (config.ep_dispatch_in_gemm)
      return bad(with +
                 "ep_dispatch_in_gemm = true; valid: at most one of them (the down dgrad's "
                 "producer warps pull the d_out rows there; the epilogue's loader uses one of "
                 "them)");
  }
  return Status::Ok();
}

bool auto_lockstep_engages(const MoeConfig& config, const MoeShape& shape) {
  // Measured slower (FP8) or not measured together (the L2 placement, the communication inside
  // the GEMMs); a caller's own choice of either knob stands.
  if (!config.gemm_auto_lockstep || config.gemm_four_stages || config.gemm_lockstep_k_blocks != 0 ||
      config.precision != Precision::kBF16 || config.gemm_l2_placement ||
      config.ep_dispatch_in_gemm || shape.num_experts < 1)
    return false;
  const int64_t routed_rows = shape.num_tokens * shape.top_k * shape.num_ranks;
  const int64_t weight_bytes =
      shape.num_local_experts() * 3 * shape.hidden * shape.intermediate * 2;
  if (routed_rows >= kAutoLockstepMaxRowsPerExpert * shape.num_experts ||
      weight_bytes <= kAutoLockstepMinWeightBytes)
    return false;
  // Whatever the knobs exclude (CTA pairs, the 256 x 192 tiles, the tiles by ticket) rules it out.
  MoeConfig resolved = config;
  resolved.gemm_four_stages = true;
  resolved.gemm_lockstep_k_blocks = kAutoLockstepKBlocks;
  return can_implement_knobs(resolved, shape.num_ranks).ok();
}

int32_t fp8_row_tile_rows_for(const MoeConfig& config, const MoeShape& shape) {
  if (config.fp8_row_tile_rows != kAutoFp8RowTileRows) return config.fp8_row_tile_rows;
  if (config.precision != Precision::kFP8Block || config.gemm_expert_groups != 0 ||
      shape.num_experts < 1)
    return 128;
  const int64_t routed_rows = shape.num_tokens * shape.top_k * shape.num_ranks;
  const bool many_rows = routed_rows >= kFp8Rows192MinRowsPerExpert * shape.num_experts;
  return many_rows && shape.intermediate >= kFp8Rows192MinIntermediate ? 192 : 128;
}

MoeConfig with_auto_choices(const MoeConfig& config, const MoeShape& shape) {
  MoeConfig resolved = config;
  if (auto_lockstep_engages(config, shape)) {
    resolved.gemm_four_stages = true;
    resolved.gemm_lockstep_k_blocks = kAutoLockstepKBlocks;
  }
  resolved.fp8_row_tile_rows = fp8_row_tile_rows_for(config, shape);
  return resolved;
}

int64_t minibatch_rows(const MoeConfig& config, const MoeShape& shape, int32_t num_sms) {
  if (config.minibatch_size != kAutoMinibatch) return config.minibatch_size;
  if (num_sms < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "minibatch_rows: num_sms = " + std::to_string(num_sms) + "; expected at least 1");
  // Column tiles per row tile of each expert-grouped GEMM: the forward's gate/up tiles hold 128
  // columns of I (128 gate + 128 up), every other row-tile form 256 output columns (the down
  // GEMM and the gate/up dgrad over H, the down dgrad over I).
  auto tiles = [](int64_t columns, int64_t width) { return (columns + width - 1) / width; };
  const int64_t narrowest = std::min(
      {tiles(shape.intermediate, 128), tiles(shape.hidden, 256), tiles(shape.intermediate, 256)});
  const int64_t row_tiles = tiles(int64_t{kMinibatchSmWaves} * num_sms, narrowest);
  int64_t rows = row_tiles * kDefaultRowAlign;
  if (config.macrobatch_size != kAutoMacrobatch) {
    while (rows < config.macrobatch_size && config.macrobatch_size % rows != 0)
      rows += kDefaultRowAlign;
    rows = std::min(rows, config.macrobatch_size);
  }
  return rows;
}

int64_t macrobatch_ring_bytes_per_row(const MoeShape& shape) {
  return 2 * (2 * shape.hidden + 5 * shape.intermediate);
}

int64_t macrobatch_ring_rows(const MoeConfig& config, const MoeShape& shape, int64_t max_rows,
                             int32_t num_sms) {
  if (config.macrobatch_size != kAutoMacrobatch)
    return std::min<int64_t>(config.macrobatch_size, max_rows);
  const int64_t bytes_per_row = macrobatch_ring_bytes_per_row(shape);
  if (max_rows * bytes_per_row <= kAutoMacrobatchRingBytes) return max_rows;
  const int64_t minibatch = minibatch_rows(config, shape, num_sms);
  const int64_t fitting = kAutoMacrobatchRingBytes / bytes_per_row;
  const int64_t rows = std::max<int64_t>(fitting / minibatch, 1) * minibatch;
  return std::min<int64_t>(rows, max_rows);
}

}  // namespace mok
