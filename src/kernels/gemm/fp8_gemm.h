// The FP8 block-scaled grouped GEMMs (fp8_gemm.cu; issue 17), shared by the host launcher and
// the kernel (plain data). Both operands e4m3 and K-major (wgmma reads FP8 only that way), fp32
// scales in mok/fp8.h's recipe, bf16 out; every product is summed per 128-long K-block on the
// tensor cores and promoted into fp32 with its scales, which is the CPU reference's product of
// the dequantized operands up to fp32 rounding. Two forms:
//   kRowTiles    for 128-row tiles of A that each belong to one expert (the schedule's):
//                out[row, n] = sum_kb (A_q[row, kb] . B_q[e, n, kb]) * scale_a[kb][row] *
//                              scale_b[e][n / 128][kb]
//                A is an activation in 1 x 128 groups, B a weight in 128 x 128 blocks: the
//                forward's gate/up and down, and the dgrads with the weights quantized
//                transposed.
//   kWeightGrad  per expert e over its rows [offsets[e], offsets[e + 1]) (multiples of 128):
//                out[e][m, n] = sum_kb (A_q[m, kb] . B_q[n, kb]) * scale_a[kb][m] * scale_b[kb][n]
//                Both are activations transposed, in groups of 128 rows (the column-group
//                quantizer's output); an expert without rows gets zeros. out is bf16 or fp32,
//                written or accumulated (Fp8WeightGradOut: out = round(out + sum), a main
//                gradient summed over micro-batches).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/common/kernel_stream.h"
#include "kernels/common/wait_types.h"
#include "kernels/gemm/gemm_ablation.h"
#include "kernels/gemm/lockstep.h"
#include "kernels/gemm/tile_tickets.h"
#include "mok/schedule.h"

namespace mok::kernels {

enum class Fp8GemmForm : int32_t { kRowTiles = 0, kWeightGrad = 1 };

// kWeightGrad's output (BackwardArgs' d_w_* dtype and accumulate_weight_grads): bf16 or fp32,
// the sum written, or added to what out holds and rounded once (one add per element a launch,
// so the result does not depend on timing). Each form but kBF16 is a kernel of its own with one
// staging tile: kF32's 64 KB take the second staging tile's and a stage's memory.
enum class Fp8WeightGradOut : int32_t { kBF16 = 0, kBF16Accumulate, kF32, kF32Accumulate };

// kRowTiles reads two operands as two tensors each where the layer keeps them apart: with
// n_split, the output columns [n_split, N) come from B2 (at n - n_split) and go to out2 (the
// gate/up GEMM: Wg and Wu, g and u); with k_split, the K-blocks [k_split, K) come from A2 and B2
// (at k - k_split: the gate/up dgrad's [d_g | d_u] times [Wg; Wu]).
struct Fp8GemmMaps {
  CUtensorMap a;          // e4m3 [rows, K] (kWeightGrad: [M, rows]): boxes [128 x 128], swizzled
  CUtensorMap a2;         // k_split: A's second part
  CUtensorMap b;          // e4m3 [E, N, K] (kWeightGrad: 2-D [N, rows]): 128 x 128, swizzled
  CUtensorMap b2;         // n_split or k_split: B's second part
  CUtensorMap a_scales;   // fp32 [K / 128, rows] (kWeightGrad: [rows / 128, M]): boxes [1 x 128]
  CUtensorMap a2_scales;  // k_split: A2's
  CUtensorMap b_scales;   // kWeightGrad: fp32 [rows / 128, N], boxes [1 x 128]
  CUtensorMap out;        // bf16 [1, rows, N] (kWeightGrad: [E, M, N]): boxes [128 rows x 64]
                          // (kWeightGrad's fp32 out: [128 rows x 32])
  CUtensorMap out2;       // n_split: the columns from n_split on
};

// kRowTiles' A rows gathered from the tokens and quantized inside the GEMM (fp8_row_gather.cuh):
// the bits of launch_gather_quantize_fp8's row groups for the schedule's rows [0, total_rows),
// counted per chunk of kFp8GatherChunkRows rows (the 192-row tiles' A boxes).
constexpr int kFp8GatherChunkRows = 64;
struct Fp8RowGather {
  const void* tokens = nullptr;       // bf16 [T, K]; null: A's rows are there already
  const int32_t* row_pair = nullptr;  // the schedule's: row r is token row_pair[r] / top_k
  int32_t top_k = 0;
  uint8_t* codes = nullptr;              // A's e4m3 rows [capacity_rows, K] (maps.a's memory)
  float* scales = nullptr;               // A's group-major scales [K / 128, capacity_rows]
  int64_t capacity_rows = 0;             // a multiple of 64
  unsigned long long* ticket = nullptr;  // one word
  unsigned long long* chunk_rows_done = nullptr;  // [capacity_rows / 64]
  unsigned long long* epoch = nullptr;  // this launch's epoch - 1 (the caller advances it after)
};

struct Fp8GemmParams {
  Fp8GemmForm form = Fp8GemmForm::kRowTiles;
  const ScheduleHeader* header = nullptr;  // kRowTiles: num_tiles, the 128-row tiles of A
  const int32_t* tile_expert = nullptr;    // kRowTiles: expert of each row tile
  const float* b_scales = nullptr;         // kRowTiles: B's [E, N / 128, K / 128] (of its part)
  const float* b2_scales = nullptr;        // kRowTiles with a split: B2's, laid out alike
  // kWeightGrad: [E + 1] row offsets; kRowTiles with expert_groups: the schedule's (multiples
  // of 128).
  const int32_t* expert_offsets = nullptr;
  int32_t num_experts = 0;  // kWeightGrad: E
  int32_t m_extent = 0;     // kWeightGrad: M, a multiple of 128
  int32_t n_extent = 0;     // N, a multiple of 128
  // kRowTiles: 0, or a multiple of 128 below N: the output's columns from n_split on go to out2
  // (the gate/up GEMM over [Wg; Wu] writes g and u to their own buffers).
  int32_t n_split = 0;
  int32_t k_extent = 0;  // kRowTiles: K, a multiple of 128
  int32_t k_split = 0;   // kRowTiles: 0, or a multiple of 128 below K (not with n_split)
  WaitContext wait{};
  GemmAblation ablation = GemmAblation::kNone;  // but in a measurement (gemm_ablation.h)
  // MoeConfig::gemm_lockstep_k_blocks: kRowTiles' CTAs kept in step (lockstep.h); ticks null: off.
  GemmLockstep lockstep{};
  // kRowTiles' walk (tile_walk.h): groups of kTileGroupM row tiles, or with expert_groups > 0
  // each expert's row tiles in groups of at most expert_groups (MoeConfig::gemm_expert_groups;
  // a kernel of its own, so that the default walk's code stays as it was). Last, so that the
  // other fields keep their offsets.
  int32_t expert_groups = 0;
  // kRowTiles: 128, or 192 (MoeConfig::fp8_row_tile_rows: fp8_gemm_192_rows.cu, with num_experts
  // and expert_offsets the schedule's; A's codes and the outputs in boxes of 64 rows, A's line
  // scales of 192).
  int32_t tile_rows = 128;
  // tile_rows 192: the schedule's routed rows per expert [num_experts], or nullptr. Given, a
  // 64-row chunk of padding alone is not computed and its output rows are not written
  // (fp8_rows192_walk.h); the layer's stages read no padding row of these outputs.
  const int32_t* expert_counts = nullptr;
  // tile_rows 192: the ticket counter and its launch epoch (tile_tickets.h, as the bf16 row
  // tiles take theirs; the caller advances the epoch after each launch), or a null counter.
  // Given, the CTAs take their tiles by ticket (fp8_gemm_192_rows.cu); launches that share the
  // counter must not run at once.
  GemmTickets tile_tickets;
  // kWeightGrad: the staging tiles its epilogue alternates between, 1 or 2. With 2 a tile's
  // staging does not wait for the previous tile's store to have read the staging tile (a store
  // that HBM's write rate paces: dsv3_e128's two K-blocks a tile write 3.8 GB of bf16 a
  // launch), for one pipeline stage fewer (4): the second tile takes its shared memory.
  int32_t weight_grad_staging_tiles = 1;
  // kRowTiles with n_split = N / 2 (the gate/up GEMM; not with expert_groups in 128-row tiles):
  // non-null, SwiGLU and h's quantization
  // run in the epilogue (fp8_swiglu_epilogue.cuh; the bits of launch_swiglu_quantize_fp8): h's
  // codes [swiglu_h_rows, n_split] e4m3 and 1 x 128 row-group scales [n_split / 128,
  // swiglu_h_rows], for the rows of the walk's chunks. A CTA takes each column tile of g with the
  // one of u of the same columns. swiglu_stores_gate_up 0: g and u are not written (a forward that
  // keeps no context).
  void* swiglu_h_codes = nullptr;
  float* swiglu_h_scales = nullptr;
  int64_t swiglu_h_rows = 0;
  float swiglu_limit = 0.0f;
  int32_t swiglu_stores_gate_up = 1;
  // kRowTiles, not with expert_groups in 128-row tiles (the gate/up GEMM of a forward whose rows
  // come from the local exchange; MoeConfig::fp8_gather_in_gate_up): row_gather.tokens non-null,
  // the producer warpgroup's spare warps gather and quantize A's rows while the TMA thread waits
  // for each tile's 64-row chunks (fp8_row_gather.cuh). Launches that share its counters must not
  // run at once.
  Fp8RowGather row_gather;
  // kWeightGrad: out's dtype and whether the sums are added to it (maps.out then fp32 for kF32*:
  // boxes [128 rows x 32]); every form but kBF16 with weight_grad_staging_tiles 1. Last, so that
  // the other fields keep their offsets (the default kernels' SASS).
  Fp8WeightGradOut weight_grad_out = Fp8WeightGradOut::kBF16;
};

// One persistent 384-thread CTA per SM at most (num_ctas). cudaErrorInvalidValue for extents
// that are not multiples of 128, for kRowTiles' K over kFp8MaxReduction (mok/fp8.h), and for
// kWeightGrad's weight_grad_staging_tiles other than 1 or 2 (1 for a weight_grad_out other
// than kBF16), and for swiglu_h_codes without
// n_extent = 2 n_split and its buffers, or with the 128-row tiles' expert groups, and for a
// row_gather without its buffers or with the 128-row tiles' expert groups.
cudaError_t launch_fp8_grouped_gemm(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                    int num_ctas, KernelStream on);
// tile_rows = 192 (launch_fp8_grouped_gemm's): one persistent 512-thread CTA per SM at most.
cudaError_t launch_fp8_gemm_192_rows(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                     int num_ctas, KernelStream on);

}  // namespace mok::kernels
