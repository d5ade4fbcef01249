// The GPU FP8 quantizers (src/kernels/stages/fp8_quantize.cu) bit-exact with the host ones
// (mok/fp8.h): every form (row groups, column groups transposed, blocks, blocks transposed) on
// random values across 2^-24 .. 2^12 and on groups that break quantizers (all zero, a NaN, an
// infinity, denormal bf16, tiny values, bf16's largest): the same codes, byte for byte, and the
// same scales (NaN where the host's is NaN); pre-quantized blocks transposed into the same bits
// as quantizing the transposed weight; rows gathered through a schedule quantized as their
// gathered copy. Then the quantizer's bandwidth at a dsv3 weight, and the gather pass's at
// dsv3_local.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "device_memory.h"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/swiglu.cuh"
#include "kernels/stages/swiglu_quantize.h"
#include "mok/fp8.h"
#include "mok/testing/routing.h"

namespace mok {
namespace {

using kernels::Fp8QuantizeForm;
using test::TimingEvents;
using test::upload;

std::vector<bf16> special_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<bf16> values(rows * cols);
  for (bf16& v : values)
    v = float_to_bf16(std::ldexp(static_cast<float>(rng.next() % 20001) / 10000.0f - 1.0f,
                                 static_cast<int>(rng.next() % 37) - 24));
  auto group = [&](int64_t row, int64_t group_idx, auto fill) {
    for (int64_t c = group_idx * 128; c < group_idx * 128 + 128; ++c)
      values[row * cols + c] = float_to_bf16(fill(c));
  };
  group(0, 0, [](int64_t) { return 0.0f; });
  group(1, 1, [](int64_t c) { return c == 140 ? NAN : 1.0f; });
  group(2, 0, [](int64_t c) { return c == 3 ? INFINITY : -2.0f; });
  group(3, 1, [](int64_t c) { return (c % 2 ? 1 : -1) * 0x1p-130f; });
  group(5, 0, [](int64_t c) { return static_cast<float>(c) * 0x1p-97f; });
  group(6, 1, [](int64_t c) { return c == 200 ? 3.3895314e38f : 1.0f; });
  // Rows past the first 32 of a tile: the column forms' later row quarters meet a NaN and an
  // infinity too.
  group(100, 0, [](int64_t c) { return c == 7 ? NAN : 0.75f; });
  group(77, 1, [](int64_t c) { return c == 250 ? -INFINITY : -0.25f; });
  return values;
}

std::vector<bf16> transposed(const std::vector<bf16>& values, int64_t rows, int64_t cols) {
  std::vector<bf16> out(values.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = values[r * cols + c];
  return out;
}

// The host quantizers' [lines, groups] scales in the GPU group forms' [groups, lines] layout.
std::vector<float> group_major(const std::vector<float>& scales, int64_t lines, int64_t groups) {
  std::vector<float> out(scales.size());
  for (int64_t l = 0; l < lines; ++l)
    for (int64_t g = 0; g < groups; ++g) out[g * lines + l] = scales[l * groups + g];
  return out;
}

TEST(Fp8QuantizeGpu, BitExactWithTheHostQuantizers) {
  const int64_t rows = 384, cols = 256;
  const std::vector<bf16> input = special_matrix(rows, cols, 9);
  const std::vector<bf16> input_t = transposed(input, rows, cols);
  test::DeviceAllocations memory;
  void* device_in = upload(memory, input);
  void* device_out = memory.allocate(input.size());
  float* device_scales = memory.allocate<float>(rows * cols / 128 * sizeof(float));
  for (const Fp8QuantizeForm form :
       {Fp8QuantizeForm::kRowGroups, Fp8QuantizeForm::kColumnGroups, Fp8QuantizeForm::kBlocks,
        Fp8QuantizeForm::kBlocksTransposed}) {
    SCOPED_TRACE(static_cast<int>(form));
    std::vector<e4m3> want(input.size());
    std::vector<float> want_scales;
    switch (form) {
      case Fp8QuantizeForm::kRowGroups:
        want_scales.resize(rows * cols / 128);
        quantize_fp8_rows(input.data(), rows, cols, want.data(), want_scales.data());
        want_scales = group_major(want_scales, rows, cols / 128);
        break;
      case Fp8QuantizeForm::kColumnGroups:
        want_scales.resize(rows * cols / 128);
        quantize_fp8_rows(input_t.data(), cols, rows, want.data(), want_scales.data());
        want_scales = group_major(want_scales, cols, rows / 128);
        break;
      case Fp8QuantizeForm::kBlocks:
        want_scales.resize(rows * cols / 128 / 128);
        quantize_fp8_blocks(input.data(), rows, cols, want.data(), want_scales.data());
        break;
      case Fp8QuantizeForm::kBlocksTransposed:
        want_scales.resize(rows * cols / 128 / 128);
        quantize_fp8_blocks(input_t.data(), cols, rows, want.data(), want_scales.data());
        break;
    }
    CUDA_CHECK(cudaMemset(device_out, 0xab, input.size()));
    ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, form, device_out, device_scales,
                                           nullptr),
              cudaSuccess);
    std::vector<e4m3> got(input.size());
    std::vector<float> got_scales(want_scales.size());
    CUDA_CHECK(cudaMemcpy(got.data(), device_out, got.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_scales.data(), device_scales, got_scales.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
    int64_t wrong = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i].bits != want[i].bits && ++wrong <= 5)
        ADD_FAILURE() << "code " << i << ": GPU 0x" << std::hex << int(got[i].bits) << ", host 0x"
                      << int(want[i].bits);
    EXPECT_EQ(wrong, 0);
    for (size_t i = 0; i < got_scales.size(); ++i) {
      if (std::isnan(want_scales[i])) {
        EXPECT_TRUE(std::isnan(got_scales[i])) << "scale " << i;
      } else {
        EXPECT_EQ(std::memcmp(&got_scales[i], &want_scales[i], sizeof(float)), 0)
            << "scale " << i << ": GPU " << got_scales[i] << ", host " << want_scales[i];
      }
    }
  }
  EXPECT_EQ(kernels::launch_quantize_fp8(device_in, 100, cols, Fp8QuantizeForm::kRowGroups,
                                         device_out, device_scales, nullptr),
            cudaErrorInvalidValue);
}

// A batch (the experts' weights in one launch): every entry as its own launch would quantize it,
// for each form, with the entries read at a stride larger than dense (an expert-strided view).
TEST(Fp8QuantizeGpu, BatchesQuantizeEachEntry) {
  const int64_t rows = 256, cols = 384, count = 3, in_stride = rows * cols + 128 * cols;
  const std::vector<bf16> input = special_matrix(in_stride * count / cols, cols, 31);
  test::DeviceAllocations memory;
  void* device_in = upload(memory, input);
  void* batched = memory.allocate(count * rows * cols);
  void* single = memory.allocate(count * rows * cols);
  float* batched_scales = memory.allocate<float>(count * rows * cols / 128 * 4);
  float* single_scales = memory.allocate<float>(count * rows * cols / 128 * 4);
  for (const Fp8QuantizeForm form :
       {Fp8QuantizeForm::kRowGroups, Fp8QuantizeForm::kColumnGroups, Fp8QuantizeForm::kBlocks,
        Fp8QuantizeForm::kBlocksTransposed}) {
    SCOPED_TRACE(static_cast<int>(form));
    const bool blocks =
        form == Fp8QuantizeForm::kBlocks || form == Fp8QuantizeForm::kBlocksTransposed;
    const int64_t scale_count = rows * cols / (blocks ? 128 * 128 : 128);
    kernels::Fp8QuantizeBatch batch;
    batch.count = count;
    batch.in_stride = in_stride;
    ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, form, batched, batched_scales,
                                           nullptr, batch),
              cudaSuccess);
    for (int64_t b = 0; b < count; ++b)
      ASSERT_EQ(
          kernels::launch_quantize_fp8(static_cast<const bf16*>(device_in) + b * in_stride, rows,
                                       cols, form, static_cast<char*>(single) + b * rows * cols,
                                       single_scales + b * scale_count, nullptr),
          cudaSuccess);
    std::vector<char> a(count * rows * cols), b(count * rows * cols);
    std::vector<float> sa(count * scale_count), sb(count * scale_count);
    CUDA_CHECK(cudaMemcpy(a.data(), batched, a.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), single, b.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(sa.data(), batched_scales, sa.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(sb.data(), single_scales, sb.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0);
    EXPECT_EQ(std::memcmp(sa.data(), sb.data(), sa.size() * 4), 0);
  }
}

// Pre-quantized weights transposed for the dgrads (launch_transpose_fp8_blocks): the codes
// and scales that quantizing the transposed bf16 weight gives (kBlocksTransposed), byte for
// byte, for a batch of experts holding NaN, infinite, zero and denormal-range blocks.
TEST(Fp8QuantizeGpu, TransposedBlocksAreTheTransposedQuantization) {
  const int64_t rows = 256, cols = 384, count = 3, values = rows * cols;
  const int64_t blocks = values / (128 * 128);
  const std::vector<bf16> input = special_matrix(count * rows, cols, 41);
  test::DeviceAllocations memory;
  void* device_in = upload(memory, input);
  void* codes = memory.allocate(count * values);
  void* want = memory.allocate(count * values);
  void* got = memory.allocate(count * values);
  float* scales = memory.allocate<float>(count * blocks * 4);
  float* want_scales = memory.allocate<float>(count * blocks * 4);
  float* got_scales = memory.allocate<float>(count * blocks * 4);
  kernels::Fp8QuantizeBatch batch;
  batch.count = count;
  ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, Fp8QuantizeForm::kBlocks, codes,
                                         scales, nullptr, batch),
            cudaSuccess);
  ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, Fp8QuantizeForm::kBlocksTransposed,
                                         want, want_scales, nullptr, batch),
            cudaSuccess);
  CUDA_CHECK(cudaMemset(got, 0xab, count * values));
  ASSERT_EQ(kernels::launch_transpose_fp8_blocks(codes, scales, rows, cols, got, got_scales,
                                                 nullptr, batch),
            cudaSuccess);
  std::vector<uint8_t> a(count * values), b(count * values);
  std::vector<float> sa(count * blocks), sb(count * blocks);
  CUDA_CHECK(cudaMemcpy(a.data(), got, a.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(b.data(), want, b.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(sa.data(), got_scales, sa.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(sb.data(), want_scales, sb.size() * 4, cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && ++wrong <= 5)
      ADD_FAILURE() << "code " << i << ": transposed 0x" << std::hex << int(a[i])
                    << ", quantized transposed 0x" << int(b[i]);
  EXPECT_EQ(wrong, 0);
  for (size_t i = 0; i < sa.size(); ++i) {
    if (std::isnan(sb[i]))
      EXPECT_TRUE(std::isnan(sa[i])) << "scale " << i;
    else
      EXPECT_EQ(std::memcmp(&sa[i], &sb[i], 4), 0)
          << "scale " << i << ": " << sa[i] << " vs " << sb[i];
  }
  EXPECT_EQ(
      kernels::launch_transpose_fp8_blocks(codes, scales, 100, cols, got, got_scales, nullptr),
      cudaErrorInvalidValue);
}

// Both layouts of the weights' blocks in one pass (launch_quantize_fp8_blocks_both): the bits
// of kBlocks and of kBlocksTransposed, byte for byte, for a batch of experts strided apart with
// special blocks (NaN, infinity, zeros, denormal bf16); either layout alone; bad extents and a
// codes pointer without its scales refused.
TEST(Fp8QuantizeGpu, BothBlockLayoutsInOnePassAreTheTwoForms) {
  const int64_t rows = 256, cols = 384, count = 3, in_stride = rows * cols + 128 * cols;
  const int64_t values = rows * cols, blocks = values / (128 * 128);
  const std::vector<bf16> input = special_matrix(in_stride * count / cols, cols, 43);
  test::DeviceAllocations memory;
  void* device_in = upload(memory, input);
  void* plain = memory.allocate(count * values);
  void* transposed = memory.allocate(count * values);
  void* both = memory.allocate(count * values);
  void* both_t = memory.allocate(count * values);
  float* plain_scales = memory.allocate<float>(count * blocks * 4);
  float* transposed_scales = memory.allocate<float>(count * blocks * 4);
  float* both_scales = memory.allocate<float>(count * blocks * 4);
  float* both_scales_t = memory.allocate<float>(count * blocks * 4);
  kernels::Fp8QuantizeBatch batch;
  batch.count = count;
  batch.in_stride = in_stride;
  ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, Fp8QuantizeForm::kBlocks, plain,
                                         plain_scales, nullptr, batch),
            cudaSuccess);
  ASSERT_EQ(kernels::launch_quantize_fp8(device_in, rows, cols, Fp8QuantizeForm::kBlocksTransposed,
                                         transposed, transposed_scales, nullptr, batch),
            cudaSuccess);
  auto expect_bytes = [&](const void* got, const void* want, int64_t bytes, const char* what) {
    std::vector<uint8_t> a(bytes), b(bytes);
    CUDA_CHECK(cudaMemcpy(a.data(), got, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), want, bytes, cudaMemcpyDeviceToHost));
    int64_t wrong = 0;
    for (int64_t i = 0; i < bytes; ++i) wrong += a[i] != b[i];
    EXPECT_EQ(wrong, 0) << what;
  };
  for (const int layouts : {3, 1, 2}) {  // both, as they are alone, transposed alone
    SCOPED_TRACE(layouts);
    for (void* p : {both, both_t}) CUDA_CHECK(cudaMemset(p, 0xab, count * values));
    for (float* p : {both_scales, both_scales_t})
      CUDA_CHECK(cudaMemset(p, 0xab, count * blocks * 4));
    const bool as_is = layouts & 1, transposed_too = layouts & 2;
    ASSERT_EQ(kernels::launch_quantize_fp8_blocks_both(
                  device_in, rows, cols, as_is ? both : nullptr, as_is ? both_scales : nullptr,
                  transposed_too ? both_t : nullptr, transposed_too ? both_scales_t : nullptr,
                  nullptr, batch),
              cudaSuccess);
    if (as_is) {
      expect_bytes(both, plain, count * values, "codes as they are");
      expect_bytes(both_scales, plain_scales, count * blocks * 4, "scales as they are");
    }
    if (transposed_too) {
      expect_bytes(both_t, transposed, count * values, "codes transposed");
      expect_bytes(both_scales_t, transposed_scales, count * blocks * 4, "scales transposed");
    }
  }
  // The kBlocks codes against the host quantizer too (the reference of both forms).
  std::vector<e4m3> want(values);
  std::vector<float> want_scales(blocks);
  std::vector<uint8_t> got(values);
  quantize_fp8_blocks(input.data() + in_stride, rows, cols, want.data(), want_scales.data());
  CUDA_CHECK(
      cudaMemcpy(got.data(), static_cast<char*>(plain) + values, values, cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (int64_t i = 0; i < values; ++i) wrong += got[i] != want[i].bits;
  EXPECT_EQ(wrong, 0) << "entry 1 against the host quantizer";
  EXPECT_EQ(kernels::launch_quantize_fp8_blocks_both(device_in, 100, cols, both, both_scales,
                                                     nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_quantize_fp8_blocks_both(device_in, rows, cols, both, nullptr, nullptr,
                                                     nullptr, nullptr),
            cudaErrorInvalidValue);
}

// A gather of `tokens` [T, cols] through the schedule (device pointers), with no outputs yet.
kernels::Fp8GatherQuantize gather_of(const void* header, const void* row_pair, int64_t top_k,
                                     const void* tokens, int64_t cols, int64_t capacity) {
  kernels::Fp8GatherQuantize params;
  params.header = static_cast<const ScheduleHeader*>(header);
  params.row_pair = static_cast<const int32_t*>(row_pair);
  params.top_k = static_cast<int32_t>(top_k);
  params.tokens = tokens;
  params.cols = cols;
  params.capacity_rows = capacity;
  return params;
}

// The local exchange's FP8 rows (launch_gather_quantize_fp8): gathered from token rows through a
// schedule with padding rows, tokens routed twice and a window past total_rows, they are the
// bits the quantizers give for the gathered bf16 rows, both group forms, every row below
// total_rows; and nothing is written past it. Without a row_pair, the rows themselves.
TEST(Fp8QuantizeGpu, GatheredRowsQuantizeAsTheGatheredCopy) {
  const int64_t tokens = 200, cols = 384, top_k = 2, capacity = 640, total = 512;
  const std::vector<bf16> x = special_matrix(tokens, cols, 51);
  std::vector<int32_t> row_pair(capacity, -1);
  SplitMix64 rng(52);
  for (int64_t r = 0; r < total; ++r)
    if (r % 7 != 3) row_pair[r] = static_cast<int32_t>(rng.next() % (tokens * top_k));
  std::vector<bf16> gathered(capacity * cols);  // zero past total_rows and on padding rows
  for (int64_t r = 0; r < total; ++r)
    if (row_pair[r] >= 0)
      std::memcpy(&gathered[r * cols], &x[(row_pair[r] / top_k) * cols], cols * sizeof(bf16));
  ScheduleHeader header{};
  header.total_rows = static_cast<int32_t>(total);
  const int64_t values = capacity * cols, scale_count = values / 128;
  test::DeviceAllocations memory;
  void* d_x = upload(memory, x);
  void* d_gathered = upload(memory, gathered);
  void* d_pairs = upload(memory, row_pair);
  void* d_header = upload(memory, std::vector<ScheduleHeader>{header});
  void* want_rows = memory.allocate(values);
  void* want_cols = memory.allocate(values);
  void* got_rows = memory.allocate(values);
  void* got_cols = memory.allocate(values);
  float* want_rs = memory.allocate<float>(scale_count * 4);
  float* want_cs = memory.allocate<float>(scale_count * 4);
  float* got_rs = memory.allocate<float>(scale_count * 4);
  float* got_cs = memory.allocate<float>(scale_count * 4);
  ASSERT_EQ(kernels::launch_quantize_fp8(d_gathered, capacity, cols, Fp8QuantizeForm::kRowGroups,
                                         want_rows, want_rs, nullptr),
            cudaSuccess);
  ASSERT_EQ(kernels::launch_quantize_fp8(d_gathered, capacity, cols, Fp8QuantizeForm::kColumnGroups,
                                         want_cols, want_cs, nullptr),
            cudaSuccess);
  for (void* p : {got_rows, got_cols}) CUDA_CHECK(cudaMemset(p, 0xab, values));
  for (float* p : {got_rs, got_cs}) CUDA_CHECK(cudaMemset(p, 0xab, scale_count * 4));
  kernels::Fp8GatherQuantize params = gather_of(d_header, d_pairs, top_k, d_x, cols, capacity);
  params.row_codes = got_rows;
  params.row_scales = got_rs;
  params.column_codes = got_cols;
  params.column_scales = got_cs;
  ASSERT_EQ(kernels::launch_gather_quantize_fp8(params, nullptr), cudaSuccess);
  auto host = [](const void* device, int64_t bytes) {
    std::vector<uint8_t> out(bytes);
    CUDA_CHECK(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost));
    return out;
  };
  const std::vector<uint8_t> wr = host(want_rows, values), gr = host(got_rows, values);
  const std::vector<uint8_t> wc = host(want_cols, values), gc = host(got_cols, values);
  const std::vector<uint8_t> wrs = host(want_rs, scale_count * 4),
                             grs = host(got_rs, scale_count * 4);
  const std::vector<uint8_t> wcs = host(want_cs, scale_count * 4),
                             gcs = host(got_cs, scale_count * 4);
  int64_t wrong = 0, untouched = 0;
  for (int64_t r = 0; r < capacity; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const bool below = r < total;
      const uint8_t row_code = gr[r * cols + c], col_code = gc[c * capacity + r];
      if (below) {
        wrong += row_code != wr[r * cols + c];
        wrong += col_code != wc[c * capacity + r];
      } else {
        untouched += row_code == 0xab && col_code == 0xab;
      }
    }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(untouched, (capacity - total) * cols) << "codes written past total_rows";
  // Row-group scales [cols/128, capacity]; column-group scales [capacity/128, cols].
  for (int64_t g = 0; g < cols / 128; ++g)
    EXPECT_EQ(std::memcmp(&grs[g * capacity * 4], &wrs[g * capacity * 4], total * 4), 0) << g;
  EXPECT_EQ(std::memcmp(gcs.data(), wcs.data(), total / 128 * cols * 4), 0);
  // Without a row_pair: the rows of the gathered copy itself, both forms in one pass.
  for (void* p : {got_rows, got_cols}) CUDA_CHECK(cudaMemset(p, 0xab, values));
  params.row_pair = nullptr;
  params.tokens = d_gathered;
  ASSERT_EQ(kernels::launch_gather_quantize_fp8(params, nullptr), cudaSuccess);
  const std::vector<uint8_t> ir = host(got_rows, values), ic = host(got_cols, values);
  int64_t identity_wrong = 0;
  for (int64_t r = 0; r < total; ++r)
    for (int64_t c = 0; c < cols; ++c)
      identity_wrong +=
          (ir[r * cols + c] != wr[r * cols + c]) + (ic[c * capacity + r] != wc[c * capacity + r]);
  EXPECT_EQ(identity_wrong, 0);
  params.capacity_rows = 100;
  EXPECT_EQ(kernels::launch_gather_quantize_fp8(params, nullptr), cudaErrorInvalidValue);
}

// h of every element with the epilogue's SwiGLU (swiglu.cuh), one thread each: the ground truth
// of the fused pass's h.
__global__ void swiglu_reference_kernel(const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                        int64_t count, float limit, __nv_bfloat16* h) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count)
    h[i] = __float2bfloat16_rn(
        kernels::swiglu_forward(__bfloat162float(gate[i]), __bfloat162float(up[i]), limit));
}

// The FP8 forward's SwiGLU + quantization pass: the codes and scales of quantizing, with the host
// quantizer, the h that the bf16 path computes. Groups with a NaN, a gate far in the negative
// (the division's slow path), zeros; with and without a clamp.
TEST(Fp8QuantizeGpu, SwigluQuantizeMatchesTheHost) {
  const int64_t rows = 256, inter = 384, count = rows * inter;
  std::vector<bf16> gate = special_matrix(rows, inter, 21), up = special_matrix(rows, inter, 22);
  for (int64_t c = 0; c < 128; ++c) gate[8 * inter + 128 + c] = float_to_bf16(-200.0f);
  gate[9 * inter + 5] = float_to_bf16(NAN);
  for (int64_t c = 0; c < 128; ++c) up[10 * inter + c] = float_to_bf16(0.0f);
  test::DeviceAllocations memory;
  void* device_gate = upload(memory, gate);
  void* device_up = upload(memory, up);
  void* device_h = memory.allocate(count * 2);
  void* device_codes = memory.allocate(count);
  float* device_scales = memory.allocate<float>(count / 128 * sizeof(float));
  for (const float limit : {INFINITY, 0.5f}) {
    SCOPED_TRACE(limit);
    swiglu_reference_kernel<<<static_cast<unsigned>((count + 255) / 256), 256>>>(
        static_cast<const __nv_bfloat16*>(device_gate),
        static_cast<const __nv_bfloat16*>(device_up), count, limit,
        static_cast<__nv_bfloat16*>(device_h));
    CUDA_CHECK(cudaMemset(device_codes, 0xab, count));
    ASSERT_EQ(kernels::launch_swiglu_quantize_fp8(device_gate, device_up, rows, inter, limit,
                                                  device_codes, device_scales, nullptr),
              cudaSuccess);
    std::vector<bf16> h(count);
    std::vector<e4m3> got(count), want(count);
    std::vector<float> got_scales(count / 128), want_scales(count / 128);
    CUDA_CHECK(cudaMemcpy(h.data(), device_h, count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got.data(), device_codes, count, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_scales.data(), device_scales, got_scales.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
    quantize_fp8_rows(h.data(), rows, inter, want.data(), want_scales.data());
    want_scales = group_major(want_scales, rows, inter / 128);
    int64_t wrong = 0;
    for (int64_t i = 0; i < count; ++i)
      if (got[i].bits != want[i].bits && ++wrong <= 5)
        ADD_FAILURE() << "code " << i << ": fused 0x" << std::hex << int(got[i].bits)
                      << ", quantized h 0x" << int(want[i].bits);
    EXPECT_EQ(wrong, 0);
    for (size_t i = 0; i < got_scales.size(); ++i) {
      if (std::isnan(want_scales[i]))
        EXPECT_TRUE(std::isnan(got_scales[i])) << "scale " << i;
      else
        EXPECT_EQ(std::memcmp(&got_scales[i], &want_scales[i], sizeof(float)), 0) << "scale " << i;
    }
  }
  EXPECT_EQ(kernels::launch_swiglu_quantize_fp8(device_gate, device_up, rows, 100, INFINITY,
                                                device_codes, device_scales, nullptr),
            cudaErrorInvalidValue);
}

// One dsv3 expert weight's worth of matrices at once (32 experts x [2048, 7168]): bytes read and
// written per second, each form (printed; the quantization must hide under the GEMMs).
TEST(Fp8QuantizeGpu, Bandwidth) {
  const int64_t rows = 32 * 2048, cols = 7168;
  test::DeviceAllocations memory;
  void* in = memory.allocate(rows * cols * 2);
  void* out = memory.allocate(rows * cols);
  float* scales = memory.allocate<float>(rows * cols / 128 * sizeof(float));
  CUDA_CHECK(cudaMemset(in, 0x3c, rows * cols * 2));
  const TimingEvents events;
  for (const Fp8QuantizeForm form :
       {Fp8QuantizeForm::kRowGroups, Fp8QuantizeForm::kColumnGroups, Fp8QuantizeForm::kBlocks,
        Fp8QuantizeForm::kBlocksTransposed}) {
    ASSERT_EQ(kernels::launch_quantize_fp8(in, rows, cols, form, out, scales, nullptr),
              cudaSuccess);
    cudaEventRecord(events.start);
    for (int i = 0; i < 10; ++i)
      kernels::launch_quantize_fp8(in, rows, cols, form, out, scales, nullptr);
    cudaEventRecord(events.stop);
    ASSERT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, events.start, events.stop);
    std::printf("  fp8 quantize form %d: %.3f ms, %.0f GB/s\n", static_cast<int>(form), ms / 10,
                rows * cols * 3.0 / (ms / 10 * 1e-3) / 1e9);
  }
  // Both block layouts in one pass (a training forward's weights): bf16 read once, two codes
  // written per value.
  void* out_t = memory.allocate(rows * cols);
  float* scales_t = memory.allocate<float>(rows * cols / (128 * 128) * sizeof(float));
  auto both = [&] {
    return kernels::launch_quantize_fp8_blocks_both(in, rows, cols, out, scales, out_t, scales_t,
                                                    nullptr);
  };
  ASSERT_EQ(both(), cudaSuccess);
  cudaEventRecord(events.start);
  for (int i = 0; i < 10; ++i) both();
  cudaEventRecord(events.stop);
  ASSERT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
  float both_ms = 0;
  cudaEventElapsedTime(&both_ms, events.start, events.stop);
  std::printf("  fp8 quantize blocks both layouts in one pass: %.3f ms, %.0f GB/s\n", both_ms / 10,
              rows * cols * 4.0 / (both_ms / 10 * 1e-3) / 1e9);
}

// The forward's gather-and-quantize pass at dsv3_local's extents (4096 tokens of 7168, top-8, an
// expert-ordered schedule of 32768 rows in 36864): random values, the tokens' rows visited in a
// shuffled order as routing scatters them. Both group forms in one pass (a training forward:
// row groups for the gate/up GEMM, column groups for the weight gradients), row groups alone (a
// forward that keeps no context) and column groups alone (what a backward gathering x's column
// groups itself would add: session 56 measured that split and kept the one pass); ms and GB/s,
// counting the gathered bf16 read once and each code written (printed; the layer's "FP8
// quantization of ... x rows" stage is this pass).
TEST(Fp8QuantizeGpu, GatherBandwidth) {
  const int64_t tokens = 4096, cols = 7168, top_k = 8, capacity = 36864, total = 32768;
  std::vector<bf16> x(tokens * cols);
  SplitMix64 rng(71);
  for (bf16& v : x)
    v = float_to_bf16(static_cast<float>(static_cast<int64_t>(rng.next() % 20001) - 10000) / 4096);
  std::vector<int32_t> row_pair(capacity, -1);
  for (int64_t r = 0; r < total; ++r) row_pair[r] = static_cast<int32_t>(r);
  for (int64_t r = total - 1; r > 0; --r)
    std::swap(row_pair[r], row_pair[static_cast<int64_t>(rng.next() % (r + 1))]);
  ScheduleHeader header{};
  header.total_rows = static_cast<int32_t>(total);
  const int64_t values = capacity * cols;
  test::DeviceAllocations memory;
  void* d_x = upload(memory, x);
  void* d_pairs = upload(memory, row_pair);
  void* d_header = upload(memory, std::vector<ScheduleHeader>{header});
  void* rows = memory.allocate(values);
  void* columns = memory.allocate(values);
  float* row_scales = memory.allocate<float>(values / 128 * 4);
  float* column_scales = memory.allocate<float>(values / 128 * 4);
  kernels::Fp8GatherQuantize params = gather_of(d_header, d_pairs, top_k, d_x, cols, capacity);
  const TimingEvents events;
  for (const int forms : {3, 1, 2}) {  // bit 0: row groups, bit 1: column groups
    const bool with_rows = forms & 1, with_columns = forms & 2;
    params.row_codes = with_rows ? rows : nullptr;
    params.row_scales = with_rows ? row_scales : nullptr;
    params.column_codes = with_columns ? columns : nullptr;
    params.column_scales = with_columns ? column_scales : nullptr;
    ASSERT_EQ(kernels::launch_gather_quantize_fp8(params, nullptr), cudaSuccess);
    cudaEventRecord(events.start);
    for (int i = 0; i < 10; ++i) kernels::launch_gather_quantize_fp8(params, nullptr);
    cudaEventRecord(events.stop);
    ASSERT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, events.start, events.stop);
    // The compulsory bytes: x read once (the grid's row-tile order keeps each column slice of
    // the token rows in L2 while its copies are gathered), the codes written.
    const double bytes = tokens * cols * 2.0 + total * cols * (forms == 3 ? 2.0 : 1.0);
    std::printf("  fp8 gather-quantize at dsv3_local, %s: %.3f ms, %.0f GB/s\n",
                forms == 3 ? "row and column groups" : (with_rows ? "row groups" : "column groups"),
                ms / 10, bytes / (ms / 10 * 1e-3) / 1e9);
  }
}

}  // namespace
}  // namespace mok
