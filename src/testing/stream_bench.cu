// The weight-streaming benchmark behind `mok stream-bench` (mok/testing/stream_bench.h).
//
// Kernel map: one CTA per SM (its dynamic shared memory is sized so no second CTA fits), two
// warps, as a GEMM's producer and consumers. Lane 0 of warp 0 is the producer of a ring of
// `num_stages` 32 KB stages, each filled by TMA loads that complete on the stage's full
// mbarrier; warp 1 is the consumer: it waits for each stage in order and releases it on the
// stage's empty mbarrier, and the producer refills a released stage at once with the load
// `num_stages` ahead. Nothing else runs: the time is the memory system's alone.
//
// The CTA walks tiles the way the expert GEMMs walk their column tiles: tile t (of E x
// rows / 256) is expert t / tiles_per_expert, rows [256 * (t % tiles_per_expert), + 256), all K,
// CTA b taking tiles b, b + grid, ... With `readers_per_tile` = 2, CTAs 2j and 2j + 1 read the
// same tile at about the same time (an expert of two row tiles, as at `dsv3_e128`). A stage is
// a block of stage_rows x stage_k elements loaded as stage_k / 64 boxes of [stage_rows, 64] (128
// bytes of each weight row per box, the 128-byte swizzle the GEMMs use); the tile's stages go
// row block by row block within each K step. The linear pattern reads the same bytes as
// consecutive 32 KB blocks, CTA b taking blocks b, b + grid, ...
//
// Two modes model a GEMM more closely. Paced (`consumer_cycles` > 0): the consumer holds each
// landed stage for that many SM cycles of modelled math before it releases it (deadlines on the
// SM clock, as walk_bench.cu's tensor-pipe model), as consumers hold a stage while its wgmmas
// run, so only num_stages - 1 stages are in flight during the math (kPacedCycles is a 128 x 256 x
// 64 K-block at ~650 TFLOP/s over 132 SMs). Until session 21 the hold was a delay after each
// wait, ~500 cycles longer than named: its paced rates were measured at ~2,000 cycles a stage.
// L2-resident (`resident_tiles` > 0): tile t reads tile t % resident_tiles, so many CTAs re-read a
// few tiles that fit in L2 (an expert of many row tiles, as at `dsv3_local`): the rate TMA delivers
// from L2.
//
// The self-check mode (a non-null `checksum`) has every lane sum the 32-bit words of each
// landed stage (an integer sum, exact in any order) into one counter per launch.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "layer/cuda_buffer.h"
#include "layer/tma.h"
#include "mok/error.h"
#include "mok/testing/stream_bench.h"
#include "testing/bench_device.h"

namespace mok {

namespace {

constexpr int32_t kTileRows = 256;
constexpr int32_t kBoxK = 64;  // elements: 128 bytes of a weight row, the swizzle span
constexpr int32_t kStageBytes = 32 * 1024;
constexpr int32_t kMaxStages = 6;
// SM cycles of one 128 x 256 x 64 K-block (4.19 MFLOP) at ~650 TFLOP/s over 132 SMs and
// ~1.75 GHz: 0.85 us.
constexpr int32_t kPacedCycles = 1500;
// Tiles an L2-resident pattern re-reads: 8 x 256 rows x K = 7168 is 29 MB, within the 50 MB L2.
constexpr int32_t kResidentTiles = 8;
// Every launch asks for this much dynamic shared memory, whatever its ring depth: one CTA per
// SM in every variant, as in the expert GEMMs.
constexpr int32_t kSharedBytes = 200 * 1024 + 1024;

struct StreamParams {
  CUtensorMap map;  // 3D [experts, rows, k] bf16, box [1, stage_rows, 64]; linear: 2D [n, 64]
  int32_t linear;
  int32_t num_experts;
  int32_t rows;
  int32_t k;
  int32_t stage_rows;
  int32_t stage_k;
  int32_t num_stages;
  int32_t readers_per_tile;
  int32_t consumer_cycles;    // paced: cycles the consumer holds each stage (0: none)
  int32_t resident_tiles;     // > 0: tile t reads tile t % resident_tiles
  int64_t num_linear_blocks;  // linear: 32 KB blocks of 256 rows of 64 elements
  unsigned long long* checksum;
  kernels::WaitContext wait;
};

__host__ __device__ inline uint32_t word_hash(uint64_t index) {
  uint64_t z = index + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

__global__ void fill_words_kernel(uint32_t* words, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    words[i] = word_hash(static_cast<uint64_t>(i));
}

__global__ void __launch_bounds__(64, 1)
    stream_weights_kernel(const __grid_constant__ StreamParams p) {
  extern __shared__ unsigned char dynamic_smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ uint64_t empty[kMaxStages];
  unsigned char* ring = &ptx::align_shared_1024<unsigned char>(dynamic_smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const int32_t row_blocks = kTileRows / p.stage_rows;
  const int32_t stages_per_tile = p.linear ? 1 : (p.k / p.stage_k) * row_blocks;
  const int32_t tiles_per_expert = p.rows / kTileRows;
  const int64_t num_tiles = p.linear
                                ? p.num_linear_blocks
                                : int64_t{p.num_experts} * tiles_per_expert * p.readers_per_tile;
  const int64_t block = blockIdx.x, grid = gridDim.x;
  const int64_t my_tiles = block < num_tiles ? (num_tiles - block + grid - 1) / grid : 0;
  const int64_t total = my_tiles * stages_per_tile;

  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&p.map);
    for (int s = 0; s < p.num_stages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], 1);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  auto issue = [&](int64_t g) {
    const int32_t slot = static_cast<int32_t>(g % p.num_stages);
    unsigned char* stage = ring + slot * kStageBytes;
    const int64_t tile = block + (g / stages_per_tile) * grid;
    ptx::mbarrier_arrive_expect_tx(&full[slot], kStageBytes);
    if (p.linear) {
      ptx::tma_load_2d(stage, &p.map, &full[slot], 0, static_cast<int32_t>(tile * kTileRows));
      return;
    }
    const int64_t read_tile = tile / p.readers_per_tile;
    const int64_t real_tile = p.resident_tiles > 0 ? read_tile % p.resident_tiles : read_tile;
    const int32_t expert = static_cast<int32_t>(real_tile / tiles_per_expert);
    const int32_t tile_row = static_cast<int32_t>(real_tile % tiles_per_expert) * kTileRows;
    const int32_t j = static_cast<int32_t>(g % stages_per_tile);
    const int32_t k0 = (j / row_blocks) * p.stage_k;
    const int32_t row0 = tile_row + (j % row_blocks) * p.stage_rows;
    for (int32_t box = 0; box < p.stage_k / kBoxK; ++box)
      ptx::tma_load_3d(stage + box * p.stage_rows * kBoxK * 2, &p.map, &full[slot],
                       k0 + box * kBoxK, row0, expert);
  };

  if (warp == 0) {
    if (lane != 0) return;
    // The producer: the first `num_stages` loads at once, then each refill when its stage is
    // released (the empty barrier's phase of round g / num_stages - 1).
    for (int64_t g = 0; g < total; ++g) {
      if (g >= p.num_stages)
        kernels::mbarrier_wait(p.wait, kernels::WaitSite::kGemmFreeStage, &empty[g % p.num_stages],
                               static_cast<uint32_t>((g / p.num_stages - 1) & 1));
      issue(g);
    }
    return;
  }
  unsigned long long sum = 0;
  long long pipe_free = 0;  // paced: when the math of the stages held so far ends
  for (int64_t g = 0; g < total; ++g) {
    const int32_t slot = static_cast<int32_t>(g % p.num_stages);
    const uint32_t parity = static_cast<uint32_t>((g / p.num_stages) & 1);
    // Paced, the stage's math starts when the previous one's ends, or when the stage lands if
    // that is later: deadlines, not a delay after each wait, so the loop's own instructions
    // cost nothing while the loads keep up (a delay loop added ~500 cycles per stage; docs/perf.md,
    // session 21).
    long long start = pipe_free;
    if (!ptx::mbarrier_test_wait(&full[slot], parity)) {
      kernels::mbarrier_wait(p.wait, kernels::WaitSite::kGemmLoadedStage, &full[slot], parity);
      start = max(start, clock64());
    }
    if (p.checksum != nullptr) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(ring + slot * kStageBytes);
      for (int i = lane; i < kStageBytes / 4; i += 32) sum += words[i];
    }
    if (p.consumer_cycles > 0) {
      if (pipe_free == 0) start = clock64();  // the first stage
      pipe_free = start + p.consumer_cycles;
      while (clock64() < pipe_free) {
      }
    }
    // Every lane's reads of the stage come before its release, and the release before the
    // TMA load that overwrites it.
    __syncwarp();
    ptx::fence_proxy_async_shared();
    if (lane == 0) ptx::mbarrier_arrive(&empty[slot]);
  }
  if (p.checksum != nullptr) atomicAdd(p.checksum, sum);
}

struct Pattern {
  const char* name;
  int32_t stage_rows;
  int32_t stage_k;
  bool linear;
  int32_t readers_per_tile;
  TmaL2Promotion promotion;
  int32_t consumer_cycles = 0;
  int32_t resident_tiles = 0;
};

// mok's expert GEMMs read their weight tiles as the first row: [256 rows x 64] boxes, 256-byte
// L2 promotion.
const Pattern kPatterns[] = {
    {"row tile 256 x 64 (the GEMMs')", 256, 64, false, 1, TmaL2Promotion::k256B},
    {"row tile, L2 promotion none", 256, 64, false, 1, TmaL2Promotion::kNone},
    {"row tile, two readers per tile", 256, 64, false, 2, TmaL2Promotion::k256B},
    {"128 x 128 (256 B of each row)", 128, 128, false, 1, TmaL2Promotion::k256B},
    {"64 x 256 (512 B of each row)", 64, 256, false, 1, TmaL2Promotion::k256B},
    {"linear 32 KB blocks", 256, 64, true, 1, TmaL2Promotion::k256B},
    {"row tile, paced (0.85 us a stage)", 256, 64, false, 1, TmaL2Promotion::k256B, kPacedCycles},
    {"two readers, paced", 256, 64, false, 2, TmaL2Promotion::k256B, kPacedCycles},
    {"L2-resident 8 tiles (delivered)", 256, 64, false, 1, TmaL2Promotion::k256B, 0,
     kResidentTiles},
};
const int32_t kRingDepths[] = {2, 3, 4, 6};

class StreamRunner {
 public:
  StreamRunner() {
    num_sms_ = current_sm_count();
    cuda_check(cudaFuncSetAttribute(stream_weights_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes),
               "cudaFuncSetAttribute(stream_weights_kernel)");
  }

  // Whether the tensor [experts, rows, k] can be read with `pattern` (its divisibility rules).
  static bool fits(const Pattern& pattern, int64_t rows, int64_t k) {
    return rows % kTileRows == 0 && k % pattern.stage_k == 0;
  }

  StreamParams params(const void* weights, int64_t experts, int64_t rows, int64_t k,
                      const Pattern& pattern, int32_t num_stages,
                      unsigned long long* checksum) const {
    StreamParams p{};
    p.linear = pattern.linear ? 1 : 0;
    p.num_experts = static_cast<int32_t>(experts);
    p.rows = static_cast<int32_t>(rows);
    p.k = static_cast<int32_t>(k);
    p.stage_rows = pattern.stage_rows;
    p.stage_k = pattern.stage_k;
    p.num_stages = num_stages;
    p.readers_per_tile = pattern.readers_per_tile;
    p.consumer_cycles = pattern.consumer_cycles;
    p.resident_tiles = pattern.resident_tiles;
    p.checksum = checksum;
    p.wait = kernels::WaitContext{20'000'000'000ull, 0, nullptr};
    const int64_t elements = experts * rows * k;
    if (pattern.linear) {
      p.num_linear_blocks = elements / (kTileRows * kBoxK);
      const int64_t dims[2] = {kBoxK, p.num_linear_blocks * kTileRows};
      const int64_t strides[1] = {kBoxK * 2};
      const int32_t box[2] = {kBoxK, kTileRows};
      p.map = make_tensor_map(weights, TmaElement::kBF16, 2, dims, strides, box, true,
                              "stream-bench weights (linear)", pattern.promotion);
    } else {
      const int64_t dims[3] = {k, rows, experts};
      const int64_t strides[2] = {k * 2, rows * k * 2};
      const int32_t box[3] = {kBoxK, pattern.stage_rows, 1};
      p.map = make_tensor_map(weights, TmaElement::kBF16, 3, dims, strides, box, true,
                              "stream-bench weights", pattern.promotion);
    }
    return p;
  }

  void launch(const StreamParams& p, cudaStream_t stream) const {
    stream_weights_kernel<<<num_sms_, 64, kSharedBytes, stream>>>(p);
    cuda_check(cudaGetLastError(), "stream_weights_kernel launch");
  }

  int num_sms() const { return num_sms_; }

 private:
  int num_sms_ = 0;
};

void fill(const DeviceBuffer& buffer) {
  const int64_t words = buffer.bytes / 4;
  fill_words_kernel<<<1024, 256>>>(buffer.as<uint32_t>(), words);
  cuda_check(cudaGetLastError(), "fill_words_kernel launch");
}

}  // namespace

std::string stream_bench_self_check() {
  // Four experts of 1024 rows x 256: sixteen tiles, twice kResidentTiles, so the L2-resident
  // pattern wraps; every pattern and depth.
  const int64_t experts = 4, rows = 1024, k = 256;
  const int64_t tiles = experts * rows / kTileRows, tile_words = kTileRows * k / 2;
  DeviceBuffer weights(experts * rows * k * 2, "stream-bench self-check weights");
  DeviceBuffer checksum(sizeof(unsigned long long), "stream-bench checksum");
  fill(weights);
  // A tile's rows are contiguous in [experts, rows, k]: tile t is words [t, t + 1) x tile_words.
  std::vector<unsigned long long> tile_sums(tiles, 0);
  for (int64_t i = 0; i < weights.bytes / 4; ++i)
    tile_sums[i / tile_words] += word_hash(static_cast<uint64_t>(i));
  StreamRunner runner;
  std::string failures;
  for (const Pattern& pattern : kPatterns) {
    if (!StreamRunner::fits(pattern, rows, k)) continue;
    for (int32_t depth : kRingDepths) {
      cuda_check(cudaMemset(checksum.pointer, 0, sizeof(unsigned long long)), "cudaMemset");
      runner.launch(runner.params(weights.pointer, experts, rows, k, pattern, depth,
                                  checksum.as<unsigned long long>()),
                    nullptr);
      unsigned long long seen = 0;
      cuda_check(cudaMemcpy(&seen, checksum.pointer, sizeof(seen), cudaMemcpyDeviceToHost),
                 "stream-bench self-check");
      unsigned long long want = 0;
      for (int64_t t = 0; t < tiles; ++t)
        want += tile_sums[pattern.resident_tiles > 0 ? t % pattern.resident_tiles : t];
      want *= static_cast<unsigned long long>(pattern.readers_per_tile);
      if (seen != want)
        failures += std::string(failures.empty() ? "" : "; ") + pattern.name + ", " +
                    std::to_string(depth) + " stages: word sum " + std::to_string(seen) +
                    ", expected " + std::to_string(want);
    }
  }
  return failures;
}

int run_stream_bench(const MoeShape& shape) {
  const std::string failures = stream_bench_self_check();
  if (!failures.empty())
    throw Error(ErrorCode::kInternal, "stream-bench self-check failed: " + failures);
  const int64_t E = shape.num_local_experts(), H = shape.hidden, I = shape.intermediate;
  struct Form {
    const char* name;
    int64_t rows, k;
  };
  const Form forms[] = {{"gate/up weights [E, 2I, H]", 2 * I, H}, {"down weights [E, H, I]", H, I}};
  DeviceBuffer weights(E * 2 * I * H * 2, "stream-bench weights");
  fill(weights);
  cuda_check(cudaDeviceSynchronize(), "stream-bench fill");
  StreamRunner runner;
  std::printf("mok stream-bench: E=%lld H=%lld I=%lld, %d CTAs (one per SM), TMA loads only\n",
              static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(I),
              runner.num_sms());
  std::printf("  self-check: every pattern and ring depth summed each word once per reader\n");
  {
    // The copy engine's device-to-device copy of half the buffer: bytes read + written.
    const size_t half = static_cast<size_t>(weights.bytes / 2);
    unsigned char* base = weights.as<unsigned char>();
    const double ms = median_event_ms(
        [&] {
          cuda_check(cudaMemcpyAsync(base + half, base, half, cudaMemcpyDeviceToDevice),
                     "cudaMemcpy");
        },
        3);
    std::printf("  device-to-device copy of %.2f GB: %.3f ms, %.2f TB/s read + written\n",
                half / 1e9, ms, 2.0 * half / ms / 1e9);
    fill(weights);
  }
  std::printf("  %-28s %-34s %s\n", "weights", "pattern",
              "TB/s of weight bytes at ring depth 2 / 3 / 4 / 6 stages (ms at 3)");
  for (const Form& form : forms) {
    const double bytes = static_cast<double>(E * form.rows * form.k * 2);
    for (const Pattern& pattern : kPatterns) {
      if (!StreamRunner::fits(pattern, form.rows, form.k)) {
        std::printf("  %-28s %-34s (does not divide rows %lld, K %lld)\n", form.name, pattern.name,
                    static_cast<long long>(form.rows), static_cast<long long>(form.k));
        continue;
      }
      std::string cells;
      double ms_at_3 = 0;
      for (int32_t depth : kRingDepths) {
        const StreamParams p =
            runner.params(weights.pointer, E, form.rows, form.k, pattern, depth, nullptr);
        const double ms = median_event_ms([&] { runner.launch(p, nullptr); }, 5);
        if (depth == 3) ms_at_3 = ms;
        char cell[32];
        std::snprintf(cell, sizeof(cell), "%s%5.2f", cells.empty() ? "" : " / ", bytes / ms / 1e9);
        cells += cell;
      }
      std::printf("  %-28s %-34s %s  (%.3f ms)\n", form.name, pattern.name, cells.c_str(), ms_at_3);
    }
  }
  return 0;
}

}  // namespace mok
