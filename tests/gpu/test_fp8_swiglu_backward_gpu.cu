// The FP8 backward's SwiGLU pass with its quantizations (src/kernels/stages/
// swiglu_backward_quantize.cu) against the three passes it replaced, run on the same inputs:
// launch_swiglu_backward, then launch_gather_quantize_fp8 on d_g and on d_u (both group forms),
// then launch_quantize_fp8's column groups on h_w. Every code, scale and d_router_weights bit
// must match: values across bf16's range with NaN, infinities and gates far negative (the
// division's second try), padding rows, negative and zero router weights, a tile only partly
// below total_rows and a tile wholly past it (left untouched), with and without the SwiGLU clamp,
// without router weights (the shared expert) and without the column groups (frozen weights),
// and each row tile's I in one CTA or split over several (the router sums through partials).
// Then the ways' times at qwen3's and dsv3_local's extents.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_backward_quantize.h"
#include "layer/cuda_buffer.h"
#include "mok/fp8.h"
#include "mok/testing/routing.h"
#include "testing/bench_device.h"

namespace mok {
namespace {

struct SwigluProblem {
  int64_t capacity = 0, total = 0, inter = 0;
  std::vector<bf16> gate, up, dh;
  std::vector<int32_t> row_pair;  // empty: rows are their own pairs
  std::vector<float> router_weights;
};

// A value in [-1, 1] times 2^e, e uniform in [-spread, spread].
bf16 spread_value(SplitMix64& rng, int spread) {
  return float_to_bf16(std::ldexp(static_cast<float>(rng.next() % 20001) / 10000.0f - 1.0f,
                                  static_cast<int>(rng.next() % (2 * spread + 1)) - spread));
}

// `special`: values across 2^-12 .. 2^12 with NaN, infinities and far negative gates (many
// vectors take the division's second try); otherwise within 2^-3 .. 2^3, as a layer's are.
SwigluProblem make_problem(int64_t capacity, int64_t total, int64_t inter, bool pairs,
                           uint64_t seed, bool special = true) {
  SwigluProblem p;
  p.capacity = capacity;
  p.total = total;
  p.inter = inter;
  SplitMix64 rng(seed);
  const int64_t count = capacity * inter;
  for (auto* m : {&p.gate, &p.up, &p.dh}) {
    m->resize(count);
    for (bf16& v : *m) v = spread_value(rng, special ? 12 : 3);
  }
  if (special) {
    p.gate[3 * inter + 17] = float_to_bf16(NAN);
    p.up[4 * inter + 130] = float_to_bf16(INFINITY);
    p.dh[5 * inter + 300 % inter] = float_to_bf16(-INFINITY);
    for (int64_t c = 0; c < inter; c += 3) p.gate[6 * inter + c] = float_to_bf16(-200.0f);
    // Rows 200-259, or those of them a smaller problem has (the bad-argument checks' 256: rows
    // past it wrote past the host vectors and corrupted the heap, session 58).
    for (int64_t r = 200; r < std::min<int64_t>(260, capacity); ++r)
      p.gate[r * inter + (r * 7) % inter] = float_to_bf16(-120.0f);
  }
  if (pairs) {
    p.row_pair.assign(capacity, -1);
    std::vector<int32_t> ids;
    for (int64_t r = 0; r < total; ++r)
      if (r % 9 != 4) ids.push_back(static_cast<int32_t>(ids.size()));
    for (int64_t i = static_cast<int64_t>(ids.size()) - 1; i > 0; --i)
      std::swap(ids[i], ids[static_cast<int64_t>(rng.next() % (i + 1))]);
    size_t next = 0;
    for (int64_t r = 0; r < total; ++r)
      if (r % 9 != 4) p.row_pair[r] = ids[next++];
    p.router_weights.resize(ids.size());
    for (float& w : p.router_weights) w = static_cast<float>(rng.next() % 4001) / 1000.0f - 2.0f;
    p.router_weights[0] = 0.0f;
  }
  return p;
}

// `bytes` of `data` into `buffer` (allocated here).
void upload(DeviceBuffer& buffer, const void* data, int64_t bytes) {
  buffer.allocate(bytes, "test input");
  cuda_check(cudaMemcpy(buffer.pointer, data, bytes, cudaMemcpyHostToDevice), "upload");
}

std::vector<uint8_t> download(const DeviceBuffer& buffer) {
  std::vector<uint8_t> out(buffer.bytes);
  cuda_check(cudaMemcpy(out.data(), buffer.pointer, buffer.bytes, cudaMemcpyDeviceToHost),
             "download");
  return out;
}

// One way's outputs: codes and scales of each form, and the router gradients.
struct SwigluOutputs {
  DeviceBuffer gate_rows, gate_row_scales, up_rows, up_row_scales;
  DeviceBuffer gate_cols, gate_col_scales, up_cols, up_col_scales, hw_cols, hw_col_scales;
  DeviceBuffer router;
  SwigluOutputs(int64_t capacity, int64_t inter, int64_t pairs) {
    const int64_t codes = capacity * inter, scales = codes / 128 * 4;
    for (DeviceBuffer* b : {&gate_rows, &up_rows, &gate_cols, &up_cols, &hw_cols}) {
      b->allocate(codes, "codes");
      cuda_check(cudaMemset(b->pointer, 0xab, codes), "memset");
    }
    for (DeviceBuffer* b :
         {&gate_row_scales, &up_row_scales, &gate_col_scales, &up_col_scales, &hw_col_scales}) {
      b->allocate(scales, "scales");
      cuda_check(cudaMemset(b->pointer, 0xab, scales), "memset");
    }
    router.allocate(std::max<int64_t>(pairs, 1) * 4, "router gradients");
    cuda_check(cudaMemset(router.pointer, 0xab, router.bytes), "memset");
  }
};

// The problem's device inputs and the launch parameters both ways share.
struct SwigluInputs {
  DeviceBuffer gate, up, dh, row_pair, weights, header;
  explicit SwigluInputs(const SwigluProblem& p) {
    upload(gate, p.gate.data(), p.gate.size() * 2);
    upload(up, p.up.data(), p.up.size() * 2);
    upload(dh, p.dh.data(), p.dh.size() * 2);
    if (!p.row_pair.empty()) {
      upload(row_pair, p.row_pair.data(), p.row_pair.size() * 4);
      upload(weights, p.router_weights.data(), p.router_weights.size() * 4);
    }
    ScheduleHeader h{};
    h.total_rows = static_cast<int32_t>(p.total);
    upload(header, &h, sizeof(h));
  }
};

// The three passes' bf16 intermediates.
struct SwigluScratch {
  DeviceBuffer d_gate, d_up, h_w;
  explicit SwigluScratch(const SwigluProblem& p)
      : d_gate(p.capacity * p.inter * 2, "d_gate"),
        d_up(p.capacity * p.inter * 2, "d_up"),
        h_w(p.capacity * p.inter * 2, "h_w") {
    for (DeviceBuffer* b : {&d_gate, &d_up, &h_w})
      cuda_check(cudaMemset(b->pointer, 0, b->bytes), "memset");
  }
};

// The three passes: the SwiGLU backward into bf16, d_g and d_u quantized both ways, h_w in
// column groups (h_w into a buffer of its own: the layer wrote it over dh_raw, the same bytes).
void three_passes(const SwigluProblem& p, const SwigluInputs& in, float limit, bool columns,
                  SwigluScratch& scratch, SwigluOutputs& out) {
  const bool pairs = in.row_pair.pointer != nullptr;
  cuda_check(kernels::launch_swiglu_backward(
                 in.header.as<ScheduleHeader>(), 0, in.gate.pointer, in.up.pointer, in.dh.pointer,
                 in.row_pair.as<int32_t>(), in.weights.as<float>(), p.inter, limit,
                 scratch.d_gate.pointer, scratch.d_up.pointer, scratch.h_w.pointer,
                 pairs ? out.router.as<float>() : nullptr, nullptr, 0, nullptr),
             "SwiGLU backward");
  auto both_ways = [&](const DeviceBuffer& source, DeviceBuffer& rows, DeviceBuffer& row_scales,
                       DeviceBuffer& cols, DeviceBuffer& col_scales) {
    kernels::Fp8GatherQuantize q;
    q.header = in.header.as<ScheduleHeader>();
    q.tokens = source.pointer;
    q.cols = p.inter;
    q.capacity_rows = p.capacity;
    q.row_codes = rows.pointer;
    q.row_scales = row_scales.as<float>();
    if (columns) {
      q.column_codes = cols.pointer;
      q.column_scales = col_scales.as<float>();
    }
    cuda_check(kernels::launch_gather_quantize_fp8(q, nullptr), "quantize both ways");
  };
  both_ways(scratch.d_gate, out.gate_rows, out.gate_row_scales, out.gate_cols, out.gate_col_scales);
  both_ways(scratch.d_up, out.up_rows, out.up_row_scales, out.up_cols, out.up_col_scales);
  if (columns)
    cuda_check(
        kernels::launch_quantize_fp8(scratch.h_w.pointer, p.capacity, p.inter,
                                     kernels::Fp8QuantizeForm::kColumnGroups, out.hw_cols.pointer,
                                     out.hw_col_scales.as<float>(), nullptr),
        "h_w column groups");
}

kernels::Fp8SwigluBackward fused_params(const SwigluProblem& p, const SwigluInputs& in, float limit,
                                        bool columns, SwigluOutputs& out) {
  kernels::Fp8SwigluBackward f;
  f.swiglu.gate = in.gate.as<const uint4>();
  f.swiglu.up = in.up.as<const uint4>();
  f.swiglu.dh_raw = in.dh.as<const uint4>();
  f.swiglu.row_pair = in.row_pair.as<int32_t>();
  f.swiglu.router_weights = in.weights.as<float>();
  f.swiglu.vectors_per_row = p.inter / 8;
  f.swiglu.limit = limit;
  f.swiglu.d_router_weights = in.row_pair.pointer != nullptr ? out.router.as<float>() : nullptr;
  f.header = in.header.as<ScheduleHeader>();
  f.capacity_rows = p.capacity;
  f.d_gate_rows = out.gate_rows.pointer;
  f.d_gate_row_scales = out.gate_row_scales.as<float>();
  f.d_up_rows = out.up_rows.pointer;
  f.d_up_row_scales = out.up_row_scales.as<float>();
  if (columns) {
    f.d_gate_columns = out.gate_cols.pointer;
    f.d_gate_column_scales = out.gate_col_scales.as<float>();
    f.d_up_columns = out.up_cols.pointer;
    f.d_up_column_scales = out.up_col_scales.as<float>();
    f.h_w_columns = out.hw_cols.pointer;
    f.h_w_column_scales = out.hw_col_scales.as<float>();
  }
  return f;
}

// The number of bytes of `got` that differ from `want`, in the codes of rows below `rows`
// (row-major [capacity, inter], or transposed [inter, capacity]).
int64_t code_mismatches(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                        int64_t capacity, int64_t inter, int64_t rows, bool transposed) {
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      const int64_t at = transposed ? c * capacity + r : r * inter + c;
      wrong += want[at] != got[at];
    }
  return wrong;
}

// Every output of the one pass (`got`) against the three passes' (`want`) for the rows below
// `touched`: row codes and scales, column codes and scales where `columns` (else left
// untouched), and `router_pairs` router-weight gradients; no row code past `touched`.
void expect_same_outputs(const SwigluOutputs& want, const SwigluOutputs& got, int64_t capacity,
                         int64_t inter, int64_t touched, bool columns, int64_t router_pairs) {
  const auto w_gr = download(want.gate_rows), g_gr = download(got.gate_rows);
  const auto w_ur = download(want.up_rows), g_ur = download(got.up_rows);
  EXPECT_EQ(code_mismatches(w_gr, g_gr, capacity, inter, touched, false), 0);
  EXPECT_EQ(code_mismatches(w_ur, g_ur, capacity, inter, touched, false), 0);
  for (int64_t at = touched * inter; at < capacity * inter; ++at)
    ASSERT_EQ(g_gr[at], 0xab) << "a row code written past total_rows' last tile";
  // Row-group scales [inter/128, capacity]; column-group scales [capacity/128, inter].
  const auto w_grs = download(want.gate_row_scales), g_grs = download(got.gate_row_scales);
  const auto w_urs = download(want.up_row_scales), g_urs = download(got.up_row_scales);
  for (int64_t g = 0; g < inter / 128; ++g) {
    EXPECT_EQ(std::memcmp(&w_grs[g * capacity * 4], &g_grs[g * capacity * 4], touched * 4), 0)
        << "d_g row scales, group " << g;
    EXPECT_EQ(std::memcmp(&w_urs[g * capacity * 4], &g_urs[g * capacity * 4], touched * 4), 0)
        << "d_u row scales, group " << g;
  }
  if (columns) {
    const std::pair<const DeviceBuffer*, const DeviceBuffer*> forms[3][2] = {
        {{&want.gate_cols, &got.gate_cols}, {&want.gate_col_scales, &got.gate_col_scales}},
        {{&want.up_cols, &got.up_cols}, {&want.up_col_scales, &got.up_col_scales}},
        {{&want.hw_cols, &got.hw_cols}, {&want.hw_col_scales, &got.hw_col_scales}}};
    const char* names[3] = {"d_g", "d_u", "h_w"};
    for (int f = 0; f < 3; ++f) {
      const auto wc = download(*forms[f][0].first), gc = download(*forms[f][0].second);
      EXPECT_EQ(code_mismatches(wc, gc, capacity, inter, touched, true), 0) << names[f];
      const auto ws = download(*forms[f][1].first), gs = download(*forms[f][1].second);
      EXPECT_EQ(std::memcmp(ws.data(), gs.data(), touched / 128 * inter * 4), 0)
          << names[f] << " column scales";
    }
  } else {
    const auto untouched = download(got.gate_cols);
    for (uint8_t byte : untouched) ASSERT_EQ(byte, 0xab) << "column codes without columns";
  }
  if (router_pairs > 0)
    EXPECT_EQ(
        std::memcmp(download(want.router).data(), download(got.router).data(), router_pairs * 4), 0)
        << "d_router_weights";
}

// How the one pass splits each row tile's I over CTAs: one CTA a tile (no router partials);
// the launcher's choice with partials (at 6 tiles, every group its own CTA); two runs with
// partials (uneven at three groups).
struct SplitCase {
  const char* name;
  bool partials;
  int32_t column_splits;
};
constexpr SplitCase kSplitCases[] = {
    {"one CTA a tile", false, 0}, {"chosen splits", true, 0}, {"two runs", true, 2}};

TEST(Fp8SwigluBackwardGpu, OnePassGivesTheThreePassesBits) {
  // 768 rows: tiles 0-3 below total_rows, tile 4 partly (520), tile 5 wholly past it.
  const int64_t capacity = 768, total = 520, touched = 640;
  for (const int64_t inter : {384, 256, 768}) {  // 3 chunks (odd), 2, and 6 (three groups)
    for (const bool pairs : {true, false}) {     // routed (router weights) or the shared expert
      const SwigluProblem p = make_problem(capacity, total, inter, pairs, 90 + inter + pairs);
      const SwigluInputs in(p);
      const int64_t num_pairs = static_cast<int64_t>(p.router_weights.size());
      DeviceBuffer partials;
      partials.allocate((inter + 255) / 256 * capacity * 4, "router-gradient partials");
      for (const float limit : {INFINITY, 0.75f})
        for (const bool columns : {true, false})
          for (const SplitCase split : kSplitCases) {
            SCOPED_TRACE("inter " + std::to_string(inter) + (pairs ? ", routed" : ", shared") +
                         ", limit " + std::to_string(limit) + (columns ? "" : ", no columns") +
                         ", " + split.name);
            SwigluOutputs want(capacity, inter, num_pairs), got(capacity, inter, num_pairs);
            SwigluScratch scratch(p);
            three_passes(p, in, limit, columns, scratch, want);
            kernels::Fp8SwigluBackward fused = fused_params(p, in, limit, columns, got);
            fused.column_splits = split.column_splits;
            if (split.partials) fused.router_grad_partials = partials.as<float>();
            ASSERT_EQ(kernels::launch_swiglu_backward_quantize_fp8(fused, nullptr), cudaSuccess);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            expect_same_outputs(want, got, capacity, inter, touched, columns,
                                pairs ? num_pairs : 0);
            if (HasFatalFailure()) return;
          }
    }
  }
  // Bad arguments: I not a multiple of 128, some column outputs without the others.
  const SwigluProblem p = make_problem(256, 256, 256, true, 7);
  const SwigluInputs in(p);
  SwigluOutputs out(256, 256, static_cast<int64_t>(p.router_weights.size()));
  kernels::Fp8SwigluBackward bad = fused_params(p, in, INFINITY, true, out);
  bad.swiglu.vectors_per_row = 12;
  EXPECT_EQ(kernels::launch_swiglu_backward_quantize_fp8(bad, nullptr), cudaErrorInvalidValue);
  bad = fused_params(p, in, INFINITY, true, out);
  bad.h_w_columns = nullptr;
  EXPECT_EQ(kernels::launch_swiglu_backward_quantize_fp8(bad, nullptr), cudaErrorInvalidValue);
  bad = fused_params(p, in, INFINITY, true, out);
  bad.column_splits = -1;
  EXPECT_EQ(kernels::launch_swiglu_backward_quantize_fp8(bad, nullptr), cudaErrorInvalidValue);
}

// Both ways timed at the FP8 layer's extents: qwen3 (65536 rows of I = 768) and dsv3_local
// (36864 of 2048), random values of a layer's range, one row in nine padding; ms each and the bytes
// the one pass moves (g, u and dh_raw read; five codes and scales written) per second (printed).
TEST(Fp8SwigluBackwardGpu, OnePassAgainstTheThreePassesTimed) {
  struct Extent {
    const char* name;
    int64_t rows, inter;
  };
  for (const Extent e : {Extent{"qwen3", 65536, 768}, Extent{"dsv3_local", 36864, 2048}}) {
    const SwigluProblem p = make_problem(e.rows, e.rows, e.inter, true, 5, false);
    const SwigluInputs in(p);
    const int64_t num_pairs = static_cast<int64_t>(p.router_weights.size());
    SwigluOutputs three(e.rows, e.inter, num_pairs), one(e.rows, e.inter, num_pairs);
    SwigluScratch scratch(p);
    const kernels::Fp8SwigluBackward fused = fused_params(p, in, INFINITY, true, one);
    DeviceBuffer partials;
    partials.allocate((e.inter + 255) / 256 * e.rows * 4, "router-gradient partials");
    kernels::Fp8SwigluBackward split = fused;
    split.router_grad_partials = partials.as<float>();
    const double three_ms =
        median_event_ms([&] { three_passes(p, in, INFINITY, true, scratch, three); }, 10);
    const double one_ms =
        median_event_ms([&] { kernels::launch_swiglu_backward_quantize_fp8(fused, nullptr); }, 10);
    const double split_ms =
        median_event_ms([&] { kernels::launch_swiglu_backward_quantize_fp8(split, nullptr); }, 10);
    const double bytes = e.rows * e.inter * (3 * 2.0 + 5 * 1.0) + e.rows * e.inter / 128 * 20.0;
    std::printf(
        "  fp8 SwiGLU backward at %s: three passes %.3f ms, one pass %.3f ms (%.0f GB/s), "
        "split as the launcher chooses %.3f ms (%.0f GB/s)\n",
        e.name, three_ms, one_ms, bytes / (one_ms * 1e-3) / 1e9, split_ms,
        bytes / (split_ms * 1e-3) / 1e9);
    EXPECT_EQ(std::memcmp(download(three.gate_cols).data(), download(one.gate_cols).data(),
                          three.gate_cols.bytes),
              0);
  }
}

}  // namespace
}  // namespace mok
