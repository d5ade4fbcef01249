// GPU builder of the routing schedule (contract and layout: include/mok/schedule.h).
//
// Map of the pipeline: four kernels on one stream, no atomics on positions, no host sync, every
// output rewritten on each launch (so no reset pass, and a captured CUDA graph can be replayed
// with new routing contents).
//
//   A  count walk    one warp per chunk of kScheduleChunkTokens tokens of one source rank
//                    (chunk c = src * chunks_per_rank + i, so chunk order is (src, token) order).
//                    The warp first stages the chunk's local expert ids in shared memory (many
//                    independent loads in flight), then walks its pairs in flat (token, k) order,
//                    32 pairs a step, one pair a lane, counting per local expert in a per-warp
//                    shared-memory counter array. Writes scratch_chunk_counts[c][e],
//                    scratch_chunk_recv[c] (tokens with a routed slot) and scratch_chunk_bad[c]
//                    (first bad pair of the chunk).
//   B  scan          one block per local expert: exclusive scan of that expert's column of chunk
//                    counts in chunk order -> scratch_chunk_prefix[c][e], expert_source_counts,
//                    expert_counts. One more block scans the per-chunk receive counts ->
//                    scratch_chunk_recv_prefix and recv_offsets.
//   C  offsets       one block: aligned segment starts (expert_offsets), tile_expert, padding
//                    rows, and the header (first bad pair = min over the chunks).
//   D  place walk    the walk of A again (same code, other template flag); now every routed pair
//                    knows its row: segment start + chunk prefix + running count + rank inside
//                    the step. Writes row_pair, row_recv, pair_row and recv_tokens.
//
// B, C and D are launched with programmatic dependent launch (PDL): each may be scheduled while
// its predecessor finishes, and waits (griddepcontrol.wait) before its first access to memory,
// so the results are those of plain stream order with less launch latency between the kernels.
// A is launched plainly: it follows the caller's work (e.g. the routing all-gather).
//
// Inside a step, lanes that hold the same local expert are found with __match_any_sync; a lane's
// rank among them is the count of lower lanes in its group, and the group's lowest lane advances
// the counter. Pairs therefore land in increasing pair index inside each segment, exactly the
// order the host builder produces: the two builders' output arrays are bit-identical.
//
// Cost, default dsv3 shape at EP=8 (R=8, T=4096, K=8, E=256: 512 chunks of 512 pairs, 32 local
// experts): A and D walk 16 steps per warp over 128 blocks; B runs 33 blocks of one 2048-chunk
// tile; C touches ~300 tiles and ~4K padding rows. Each kernel is a few microseconds, mostly
// launch and memory latency (R=1 at the same T takes as long). Measured on an H200
// (ScheduleGpu.Timing, median of 100): 20 us per CUDA graph replay, 22 us per stream launch
// (22 and 27 us without PDL), under 1% of a layer forward of several milliseconds.
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "mok/schedule_gpu.h"

namespace mok {

namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// Walk kernels (A and D): warps per block, loads each lane keeps in flight while staging, and the
// default dynamic shared memory limit above which a kernel must opt in (cudaFuncSetAttribute).
constexpr int kWalkWarpsPerBlock = 4;
constexpr int kStageBatch = 8;
constexpr int64_t kDefaultSharedBytes = 48 * 1024;

// Scan kernel (B): one tile covers kScanThreads * kScanItems chunks.
constexpr int kScanThreads = 512;
constexpr int kScanItems = 4;
constexpr int kMaxRanks = 1024;  // validate_schedule_params' bound on num_ranks

// Offsets kernel (C): one block; one tile covers kOffsetsThreads * kOffsetsItems experts.
constexpr int kOffsetsThreads = 1024;
constexpr int kOffsetsItems = 2;

// Everything the kernels read about the problem, precomputed on the host and passed by value.
struct BuildArgs {
  ScheduleView view;
  int32_t num_ranks;
  int32_t tokens_per_rank;
  int32_t top_k;
  int32_t num_experts;
  int32_t num_local_experts;
  int32_t first_local_expert;
  int32_t row_align;
  int32_t chunks_per_rank;
  int32_t num_chunks;
};

enum class WalkPass { kCount, kPlace };

// Shared-memory words one walking warp needs: its counters [E_loc], the receive-list entry of
// each token of its chunk, and the staged local expert of each pair of the chunk.
__host__ __device__ inline int64_t walk_words_per_warp(int32_t num_local_experts, int32_t top_k) {
  return static_cast<int64_t>(num_local_experts) + kScheduleChunkTokens +
         static_cast<int64_t>(kScheduleChunkTokens) * top_k;
}

// The local expert of an expert id, or -1 when the pair is not routed here. Ids outside
// [-1, E) can never fall inside the local range, so bad ids behave as -1 without extra checks.
__device__ __forceinline__ int32_t local_expert_of(int64_t expert, const BuildArgs& args) {
  const int64_t local = expert - args.first_local_expert;
  return (local >= 0 && local < args.num_local_experts) ? static_cast<int32_t>(local) : -1;
}

__device__ __forceinline__ bool is_bad_expert(int64_t expert, const BuildArgs& args) {
  return expert < -1 || expert >= args.num_experts;
}

// One warp walks one chunk. kCount counts pairs per local expert and receive entries and finds
// the first bad pair; kPlace, run after the scans, writes every routed pair into its row. Both
// passes visit pairs in the same order and group them the same way, which is what makes the
// counts of pass A the exact row budget of pass D.
template <typename ExpertId, WalkPass kPass>
__device__ __forceinline__ void walk_chunk(const BuildArgs& args,
                                           const ExpertId* __restrict__ routing, int32_t chunk,
                                           int32_t* counters, int32_t* token_entry,
                                           int32_t* staged_local) {
  constexpr bool kPlace = kPass == WalkPass::kPlace;
  const ScheduleView& view = args.view;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const unsigned lanes_below = (1u << lane) - 1u;

  const int32_t src_rank = chunk / args.chunks_per_rank;
  const int32_t first_token = (chunk - src_rank * args.chunks_per_rank) * kScheduleChunkTokens;
  const int32_t num_tokens = min(kScheduleChunkTokens, args.tokens_per_rank - first_token);
  const int32_t first_pair = (src_rank * args.tokens_per_rank + first_token) * args.top_k;
  const int32_t num_pairs = num_tokens * args.top_k;
  const int64_t chunk_row = static_cast<int64_t>(chunk) * args.num_local_experts;
  const ExpertId* chunk_ids = routing + first_pair;

  // Counting starts from zero; placing starts from the chunk's first row in each segment.
  for (int32_t e = lane; e < args.num_local_experts; e += kWarpSize)
    counters[e] = kPlace ? view.expert_offsets[e] + view.scratch_chunk_prefix[chunk_row + e] : 0;

  // Stage the chunk's local expert ids: kStageBatch independent loads per lane in flight, instead
  // of one dependent load per walk step. The count pass also finds the first bad id here; the
  // batches go in increasing pair order, so the first non-empty ballot holds it.
  int32_t first_bad = -1;  // warp-uniform
  for (int32_t base = 0; base < num_pairs; base += kWarpSize * kStageBatch) {
    int64_t experts[kStageBatch];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int32_t index = base + b * kWarpSize + lane;
      experts[b] = index < num_pairs ? static_cast<int64_t>(chunk_ids[index]) : -1;
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int32_t index = base + b * kWarpSize + lane;
      if (index < num_pairs) staged_local[index] = local_expert_of(experts[b], args);
      if constexpr (!kPlace) {
        const unsigned bad_lanes = __ballot_sync(kFullWarp, is_bad_expert(experts[b], args));
        if (first_bad < 0 && bad_lanes != 0u)
          first_bad = first_pair + base + b * kWarpSize + __ffs(bad_lanes) - 1;
      }
    }
  }
  __syncwarp();  // staged_local is complete before lanes read each other's entries

  // Receive list: lane = token; a token with at least one routed slot takes the next entry.
  const int32_t first_entry = kPlace ? view.scratch_chunk_recv_prefix[chunk] : 0;
  int32_t entries = 0;  // warp-uniform
  for (int32_t token0 = 0; token0 < num_tokens; token0 += kWarpSize) {
    const int32_t token = token0 + lane;
    bool routed = false;
    if (token < num_tokens) {
      const int32_t* slots = staged_local + token * args.top_k;
      for (int32_t k = 0; k < args.top_k; ++k) routed |= slots[k] >= 0;
    }
    const unsigned routed_lanes = __ballot_sync(kFullWarp, routed);
    if constexpr (kPlace) {
      const int32_t entry =
          routed ? first_entry + entries + __popc(routed_lanes & lanes_below) : -1;
      token_entry[token] = entry;
      if (routed) view.recv_tokens[entry] = first_token + token;
    }
    entries += __popc(routed_lanes);
  }
  __syncwarp();  // counters and token_entry are complete before any lane reads them

  for (int32_t step = 0; step < num_pairs; step += kWarpSize) {
    const int32_t index = step + lane;  // pair index inside the chunk
    const bool in_chunk = index < num_pairs;
    const int32_t local = in_chunk ? staged_local[index] : -1;
    const unsigned peers = __match_any_sync(kFullWarp, local);
    const int32_t rank_in_step = __popc(peers & lanes_below);
    if constexpr (kPlace) {
      if (in_chunk) {
        const int32_t pair = first_pair + index;
        if (local >= 0) {
          const int32_t row = counters[local] + rank_in_step;
          view.row_pair[row] = pair;
          view.row_recv[row] = token_entry[index / args.top_k];
          view.pair_row[pair] = row;
        } else {
          view.pair_row[pair] = -1;
        }
      }
    }
    __syncwarp();  // every lane has read its counter before the group leader advances it
    if (local >= 0 && rank_in_step == 0) counters[local] += __popc(peers);
    __syncwarp();
  }

  if constexpr (!kPlace) {
    for (int32_t e = lane; e < args.num_local_experts; e += kWarpSize)
      view.scratch_chunk_counts[chunk_row + e] = counters[e];
    if (lane == 0) {
      view.scratch_chunk_recv[chunk] = entries;
      view.scratch_chunk_bad[chunk] = first_bad;
    }
  }
}

// Kernels A and D. Dynamic shared memory: walk_words_per_warp(E_loc, K) words per warp.
template <typename ExpertId, WalkPass kPass>
__global__ void __launch_bounds__(kWalkWarpsPerBlock* kWarpSize)
    schedule_walk_kernel(BuildArgs args, const ExpertId* __restrict__ routing) {
  extern __shared__ int32_t walk_shared[];
  // The count walk follows the caller's work plainly; the place walk waits for the offsets.
  // Either lets the next kernel be scheduled early: one launched overlapped waits for it.
  if constexpr (kPass == WalkPass::kPlace)
    ptx::begin_after_previous_kernel();
  else
    ptx::let_next_kernel_launch();
  const int32_t warp = static_cast<int32_t>(threadIdx.x) / kWarpSize;
  const int32_t warps_per_block = static_cast<int32_t>(blockDim.x) / kWarpSize;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp;
  if (chunk >= args.num_chunks) return;  // the whole warp leaves together
  int32_t* counters = walk_shared + warp * walk_words_per_warp(args.num_local_experts, args.top_k);
  int32_t* token_entry = counters + args.num_local_experts;
  int32_t* staged_local = token_entry + kScheduleChunkTokens;
  walk_chunk<ExpertId, kPass>(args, routing, static_cast<int32_t>(chunk), counters, token_entry,
                              staged_local);
}

// Kernel B: block e < E_loc scans column e of scratch_chunk_counts; block E_loc scans
// scratch_chunk_recv. Chunks of one source rank are contiguous, so the prefix at a rank's first
// chunk is that rank's start, and differences of starts are per-rank totals.
__global__ void __launch_bounds__(kScanThreads) schedule_scan_kernel(BuildArgs args) {
  using BlockScan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int32_t rank_start[kMaxRanks + 1];

  ptx::wait_for_previous_kernel();
  ptx::let_next_kernel_launch();
  const ScheduleView& view = args.view;
  const int32_t column = static_cast<int32_t>(blockIdx.x);
  const bool recv_block = column == args.num_local_experts;
  const int64_t stride = recv_block ? 1 : args.num_local_experts;
  const int32_t* values = recv_block ? view.scratch_chunk_recv : view.scratch_chunk_counts + column;
  int32_t* prefix =
      recv_block ? view.scratch_chunk_recv_prefix : view.scratch_chunk_prefix + column;

  // With T = 0 there are no chunks and every rank starts at 0.
  for (int32_t s = threadIdx.x; s <= args.num_ranks; s += kScanThreads) rank_start[s] = 0;
  __syncthreads();

  int32_t carried = 0;  // block-uniform sum of the tiles before this one
  constexpr int64_t kTileChunks = static_cast<int64_t>(kScanThreads) * kScanItems;
  for (int64_t tile = 0; tile < args.num_chunks; tile += kTileChunks) {
    const int64_t first = tile + static_cast<int64_t>(threadIdx.x) * kScanItems;
    int32_t items[kScanItems];
#pragma unroll
    for (int i = 0; i < kScanItems; ++i)
      items[i] = first + i < args.num_chunks ? values[(first + i) * stride] : 0;
    int32_t tile_total;
    BlockScan(scan_storage).ExclusiveSum(items, items, tile_total);
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int64_t chunk = first + i;
      if (chunk >= args.num_chunks) break;
      const int32_t exclusive = carried + items[i];
      prefix[chunk * stride] = exclusive;
      if (chunk % args.chunks_per_rank == 0) rank_start[chunk / args.chunks_per_rank] = exclusive;
    }
    carried += tile_total;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  if (threadIdx.x == 0) rank_start[args.num_ranks] = carried;
  __syncthreads();

  if (recv_block) {
    for (int32_t s = threadIdx.x; s <= args.num_ranks; s += kScanThreads)
      view.recv_offsets[s] = rank_start[s];
    return;
  }
  int32_t* source_counts =
      view.expert_source_counts + static_cast<int64_t>(column) * args.num_ranks;
  for (int32_t s = threadIdx.x; s < args.num_ranks; s += kScanThreads)
    source_counts[s] = rank_start[s + 1] - rank_start[s];
  if (threadIdx.x == 0) view.expert_counts[column] = carried;
}

// Kernel C: one block. Segment starts, tile owners, padding rows and the header.
template <typename ExpertId>
__global__ void __launch_bounds__(kOffsetsThreads)
    schedule_offsets_kernel(BuildArgs args, const ExpertId* __restrict__ routing) {
  using BlockScan = cub::BlockScan<int32_t, kOffsetsThreads>;
  using BlockReduce = cub::BlockReduce<uint32_t, kOffsetsThreads>;
  __shared__ union {
    typename BlockScan::TempStorage scan;
    typename BlockReduce::TempStorage reduce;
  } storage;

  ptx::wait_for_previous_kernel();
  ptx::let_next_kernel_launch();
  const ScheduleView& view = args.view;
  const int32_t local_experts = args.num_local_experts;
  const int32_t align = args.row_align;

  // Segment starts: exclusive scan of the counts rounded up to the tile height.
  int32_t total_rows = 0;  // block-uniform
  constexpr int32_t kTileExperts = kOffsetsThreads * kOffsetsItems;
  for (int32_t tile = 0; tile < local_experts; tile += kTileExperts) {
    const int32_t first = tile + static_cast<int32_t>(threadIdx.x) * kOffsetsItems;
    int32_t items[kOffsetsItems];
#pragma unroll
    for (int i = 0; i < kOffsetsItems; ++i) {
      const int32_t count = first + i < local_experts ? view.expert_counts[first + i] : 0;
      items[i] = (count + align - 1) / align * align;
    }
    int32_t tile_rows;
    BlockScan(storage.scan).ExclusiveSum(items, items, tile_rows);
#pragma unroll
    for (int i = 0; i < kOffsetsItems; ++i)
      if (first + i < local_experts) view.expert_offsets[first + i] = total_rows + items[i];
    total_rows += tile_rows;
    __syncthreads();  // storage is reused
  }
  if (threadIdx.x == 0) view.expert_offsets[local_experts] = total_rows;

  // First bad pair over all chunks; as unsigned, "none" (-1) is the largest value.
  uint32_t first_bad = UINT32_MAX;
  for (int32_t c = threadIdx.x; c < args.num_chunks; c += kOffsetsThreads)
    first_bad = min(first_bad, static_cast<uint32_t>(view.scratch_chunk_bad[c]));
  first_bad = BlockReduce(storage.reduce).Reduce(first_bad, [](uint32_t a, uint32_t b) {
    return a < b ? a : b;
  });               // valid in thread 0
  __syncthreads();  // expert_offsets written above are visible to the whole block

  if (threadIdx.x == 0) {
    ScheduleHeader header{};
    header.total_rows = total_rows;
    header.num_tiles = total_rows / align;
    header.total_recv = view.recv_offsets[args.num_ranks];
    if (first_bad == UINT32_MAX) {
      header.status = static_cast<int32_t>(ScheduleStatus::kOk);
      header.error_pair = -1;
      header.error_value = 0;
    } else {
      header.status = static_cast<int32_t>(ScheduleStatus::kBadExpertId);
      header.error_pair = static_cast<int32_t>(first_bad);
      header.error_value = saturate_expert_id(static_cast<int64_t>(routing[first_bad]));
    }
    *view.header = header;
  }

  // Owner of each tile: the last segment starting at or before the tile's first row (empty
  // segments share their start with the next one, so "last" skips them).
  const int32_t num_tiles = total_rows / align;
  for (int32_t tile = threadIdx.x; tile < num_tiles; tile += kOffsetsThreads) {
    const int32_t row = tile * align;
    int32_t lo = 0;
    int32_t hi =
        local_experts;  // invariant: offsets[lo] <= row, and offsets[hi] > row or hi = E_loc
    while (hi - lo > 1) {
      const int32_t mid = (lo + hi) / 2;
      if (view.expert_offsets[mid] <= row)
        lo = mid;
      else
        hi = mid;
    }
    view.tile_expert[tile] = lo;
  }

  // Padding rows: one warp per segment at a time; a segment has fewer than row_align of them.
  const int32_t warp = static_cast<int32_t>(threadIdx.x) / kWarpSize;
  const int32_t lane = static_cast<int32_t>(threadIdx.x) % kWarpSize;
  constexpr int32_t kWarps = kOffsetsThreads / kWarpSize;
  for (int32_t e = warp; e < local_experts; e += kWarps) {
    const int32_t padding_start = view.expert_offsets[e] + view.expert_counts[e];
    const int32_t segment_end = view.expert_offsets[e + 1];
    for (int32_t row = padding_start + lane; row < segment_end; row += kWarpSize) {
      view.row_pair[row] = -1;
      view.row_recv[row] = -1;
    }
  }
}

std::string shape_string(const ScheduleParams& p) {
  return "R=" + std::to_string(p.num_ranks) + " T=" + std::to_string(p.tokens_per_rank) +
         " K=" + std::to_string(p.top_k) + " E=" + std::to_string(p.num_experts) +
         " local_rank=" + std::to_string(p.local_rank);
}

Status cuda_failure(const char* what, cudaError_t error, const ScheduleParams& params) {
  return Status{ErrorCode::kCudaError, std::string("launch_build_schedule: ") + what +
                                           " failed: " + cudaGetErrorString(error) + " (" +
                                           shape_string(params) + ")"};
}

// The layout must be the one ScheduleLayout::make gives for its params: the kernels trust every
// offset in it.
Status check_layout(const ScheduleLayout& layout) {
  MOK_RETURN_IF_ERROR(validate_schedule_params(layout.params));
  const ScheduleLayout expected = ScheduleLayout::make(layout.params);
  struct Field {
    const char* name;
    int64_t got;
    int64_t want;
  };
  const Field fields[] = {
      {"header", layout.header, expected.header},
      {"expert_counts", layout.expert_counts, expected.expert_counts},
      {"expert_source_counts", layout.expert_source_counts, expected.expert_source_counts},
      {"expert_offsets", layout.expert_offsets, expected.expert_offsets},
      {"tile_expert", layout.tile_expert, expected.tile_expert},
      {"row_pair", layout.row_pair, expected.row_pair},
      {"row_recv", layout.row_recv, expected.row_recv},
      {"pair_row", layout.pair_row, expected.pair_row},
      {"recv_offsets", layout.recv_offsets, expected.recv_offsets},
      {"recv_tokens", layout.recv_tokens, expected.recv_tokens},
      {"scratch_chunk_counts", layout.scratch_chunk_counts, expected.scratch_chunk_counts},
      {"scratch_chunk_prefix", layout.scratch_chunk_prefix, expected.scratch_chunk_prefix},
      {"scratch_chunk_recv", layout.scratch_chunk_recv, expected.scratch_chunk_recv},
      {"scratch_chunk_recv_prefix", layout.scratch_chunk_recv_prefix,
       expected.scratch_chunk_recv_prefix},
      {"scratch_chunk_bad", layout.scratch_chunk_bad, expected.scratch_chunk_bad},
      {"output_bytes", layout.output_bytes, expected.output_bytes},
      {"total_bytes", layout.total_bytes, expected.total_bytes},
  };
  for (const Field& field : fields)
    if (field.got != field.want)
      return Status::invalid("launch_build_schedule: argument `layout` has " +
                             std::string(field.name) + " = " + std::to_string(field.got) +
                             "; ScheduleLayout::make gives " + std::to_string(field.want) +
                             " for these params; build the layout with ScheduleLayout::make");
  return Status::Ok();
}

// Warps per block of the walk kernels and their dynamic shared memory. Four warps fit the
// default 48 KB while E_loc + 64 * K stays under ~3000 words; beyond, fewer warps per block,
// then one warp with an opt-in limit.
struct WalkConfig {
  int32_t warps_per_block;
  int64_t shared_bytes;
};

Status plan_walk(const ScheduleParams& params, WalkConfig* config) {
  const int64_t bytes_per_warp = walk_words_per_warp(params.num_local_experts(), params.top_k) *
                                 static_cast<int64_t>(sizeof(int32_t));
  int64_t warps = kDefaultSharedBytes / bytes_per_warp;
  if (warps >= 1) {
    config->warps_per_block =
        static_cast<int32_t>(warps < kWalkWarpsPerBlock ? warps : kWalkWarpsPerBlock);
    config->shared_bytes = config->warps_per_block * bytes_per_warp;
    return Status::Ok();
  }
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return cuda_failure("cudaGetDevice", error, params);
  int optin_bytes = 0;
  error = cudaDeviceGetAttribute(&optin_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (error != cudaSuccess) return cuda_failure("cudaDeviceGetAttribute", error, params);
  if (bytes_per_warp > optin_bytes)
    return Status::unsupported(
        "launch_build_schedule: E_loc = " + std::to_string(params.num_local_experts()) +
        " local experts need " + std::to_string(bytes_per_warp) +
        " bytes of shared memory per walking warp; this device allows " +
        std::to_string(optin_bytes) + " per block");
  config->warps_per_block = 1;
  config->shared_bytes = bytes_per_warp;
  return Status::Ok();
}

template <typename KernelPointer>
Status allow_shared_bytes(KernelPointer kernel, int64_t shared_bytes,
                          const ScheduleParams& params) {
  if (shared_bytes <= kDefaultSharedBytes) return Status::Ok();
  const cudaError_t error = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
  if (error != cudaSuccess) return cuda_failure("cudaFuncSetAttribute", error, params);
  return Status::Ok();
}

Status check_launch(const char* kernel, cudaError_t launch_error, const ScheduleParams& params) {
  const cudaError_t error = launch_error != cudaSuccess ? launch_error : cudaGetLastError();
  if (error != cudaSuccess) return cuda_failure(kernel, error, params);
  return Status::Ok();
}

template <typename ExpertId>
Status launch_pipeline(const BuildArgs& args, const ScheduleParams& params, const ExpertId* routing,
                       cudaStream_t stream) {
  WalkConfig walk;
  MOK_RETURN_IF_ERROR(plan_walk(params, &walk));
  auto* count_kernel = schedule_walk_kernel<ExpertId, WalkPass::kCount>;
  auto* place_kernel = schedule_walk_kernel<ExpertId, WalkPass::kPlace>;
  MOK_RETURN_IF_ERROR(allow_shared_bytes(count_kernel, walk.shared_bytes, params));
  MOK_RETURN_IF_ERROR(allow_shared_bytes(place_kernel, walk.shared_bytes, params));

  const int64_t walk_blocks =
      (static_cast<int64_t>(args.num_chunks) + walk.warps_per_block - 1) / walk.warps_per_block;
  const dim3 walk_grid(static_cast<unsigned>(walk_blocks));
  const dim3 walk_block(static_cast<unsigned>(walk.warps_per_block * kWarpSize));
  const size_t walk_shared = static_cast<size_t>(walk.shared_bytes);

  // With T = 0 there is nothing to walk; the scan and offsets kernels still write every output.
  if (walk_blocks > 0) {
    count_kernel<<<walk_grid, walk_block, walk_shared, stream>>>(args, routing);
    MOK_RETURN_IF_ERROR(check_launch("kernel `count walk`", cudaSuccess, params));
  }
  const dim3 scan_grid(static_cast<unsigned>(args.num_local_experts + 1));
  MOK_RETURN_IF_ERROR(
      check_launch("kernel `scan`",
                   kernels::launch_maybe_overlapped(schedule_scan_kernel, scan_grid,
                                                    dim3(kScanThreads), 0, {stream, true}, 1, args),
                   params));
  MOK_RETURN_IF_ERROR(check_launch(
      "kernel `offsets`",
      kernels::launch_maybe_overlapped(schedule_offsets_kernel<ExpertId>, dim3(1),
                                       dim3(kOffsetsThreads), 0, {stream, true}, 1, args, routing),
      params));
  if (walk_blocks > 0)
    MOK_RETURN_IF_ERROR(check_launch(
        "kernel `place walk`",
        kernels::launch_maybe_overlapped(place_kernel, walk_grid, walk_block, walk_shared,
                                         {stream, true}, 1, args, routing),
        params));
  return Status::Ok();
}

}  // namespace

Status launch_build_schedule(const ScheduleLayout& layout, const void* top_experts_all,
                             DType expert_dtype, void* buffer, cudaStream_t stream) {
  MOK_RETURN_IF_ERROR(check_layout(layout));
  const ScheduleParams& params = layout.params;
  if (expert_dtype != DType::kInt32 && expert_dtype != DType::kInt64)
    return Status::invalid(std::string("launch_build_schedule: argument `expert_dtype` is ") +
                           dtype_name(expert_dtype) + "; valid: int32, int64");
  if (buffer == nullptr)
    return Status::invalid("launch_build_schedule: argument `buffer` is null; it must hold " +
                           std::to_string(layout.total_bytes) + " bytes of device memory");
  if (reinterpret_cast<uintptr_t>(buffer) % alignof(int32_t) != 0)
    return Status::invalid("launch_build_schedule: argument `buffer` is not 4-byte aligned");
  if (params.num_pairs() > 0 && top_experts_all == nullptr)
    return Status::invalid("launch_build_schedule: argument `top_experts_all` is null for " +
                           shape_string(params));
  if (reinterpret_cast<uintptr_t>(top_experts_all) % dtype_size(expert_dtype) != 0)
    return Status::invalid(std::string("launch_build_schedule: argument `top_experts_all` is not "
                                       "aligned to its dtype ") +
                           dtype_name(expert_dtype));

  BuildArgs args;
  args.view = ScheduleView::at(buffer, layout);
  args.num_ranks = params.num_ranks;
  args.tokens_per_rank = params.tokens_per_rank;
  args.top_k = params.top_k;
  args.num_experts = params.num_experts;
  args.num_local_experts = params.num_local_experts();
  args.first_local_expert = params.first_local_expert();
  args.row_align = params.row_align;
  args.chunks_per_rank = params.chunks_per_rank();
  args.num_chunks = params.num_chunks();

  if (expert_dtype == DType::kInt64)
    return launch_pipeline(args, params, static_cast<const int64_t*>(top_experts_all), stream);
  return launch_pipeline(args, params, static_cast<const int32_t*>(top_experts_all), stream);
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const kernels::KernelPreloadList kPreload(
    "schedule.cu", {kernels::kernel_symbol(&schedule_walk_kernel<int32_t, WalkPass::kCount>),
                    kernels::kernel_symbol(&schedule_walk_kernel<int32_t, WalkPass::kPlace>),
                    kernels::kernel_symbol(&schedule_walk_kernel<int64_t, WalkPass::kCount>),
                    kernels::kernel_symbol(&schedule_walk_kernel<int64_t, WalkPass::kPlace>),
                    kernels::kernel_symbol(&schedule_scan_kernel),
                    kernels::kernel_symbol(&schedule_offsets_kernel<int32_t>),
                    kernels::kernel_symbol(&schedule_offsets_kernel<int64_t>)});
}  // namespace

}  // namespace mok
