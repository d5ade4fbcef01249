// The FP8 GEMM tests' problems (test_fp8_gemm_gpu.cu checks them, test_fp8_gemm_rate_gpu.cu
// times them): device buffers, TMA maps and kernel parameters of a row-tile problem and of a
// weight-gradient problem, and a row-tile problem's maps for the 192-row tiles.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "device_memory.h"
#include "kernels/common/kernel_stream.h"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/fp8_rows192_walk.h"
#include "kernels/stages/launch.h"
#include "layer/tma.h"
#include "mok/schedule.h"
#include "wait_record.h"

namespace mok::test {

// Device copies of one problem and the kernel's maps.
struct Fp8GemmProblem {
  DeviceAllocations device;  // owns the buffers below
  int64_t rows = 0, n = 0, k = 0, experts = 0;
  void *a = nullptr, *b = nullptr, *out = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;
  int32_t* tile_expert = nullptr;
  int32_t* expert_offsets = nullptr;  // rows, for the expert groups' walk
  ScheduleHeader* header = nullptr;
  kernels::Fp8GemmMaps maps{};
  kernels::Fp8GemmParams params{};
  // The 192-row tiles' ticket counter and epoch (params.tile_tickets takes them to run by
  // ticket), and the launches run by ticket so far: run() advances the epoch after each, as the
  // layer does.
  kernels::GemmTickets tickets;
  int64_t launches_by_ticket = 0;
  int sm_count = kernels::current_sm_count();  // run()'s grid by default

  Fp8GemmProblem(int64_t rows_, int64_t n_, int64_t k_, int64_t experts_)
      : rows(rows_), n(n_), k(k_), experts(experts_) {
    a = device.allocate(rows * k);
    b = device.allocate(experts * n * k);
    out = device.allocate(rows * n * 2);
    a_scales = device.allocate<float>(rows * (k / 128) * 4);
    b_scales = device.allocate<float>(experts * (n / 128) * (k / 128) * 4);
    tile_expert = device.allocate<int32_t>(rows / 128 * 4);
    expert_offsets = device.allocate<int32_t>((experts + 1) * 4);
    header = device.allocate<ScheduleHeader>(sizeof(ScheduleHeader));
    tickets.counter = device.allocate<unsigned long long>(2 * sizeof(unsigned long long));
    tickets.epoch = tickets.counter + 1;
    EXPECT_EQ(cudaMemset(tickets.counter, 0, 2 * sizeof(unsigned long long)), cudaSuccess);
    ScheduleHeader host_header{};
    host_header.total_rows = static_cast<int32_t>(rows);
    host_header.num_tiles = static_cast<int32_t>(rows / 128);
    EXPECT_EQ(cudaMemcpy(header, &host_header, sizeof(host_header), cudaMemcpyHostToDevice),
              cudaSuccess);
    const int64_t a_dims[2] = {k, rows}, a_strides[1] = {k};
    const int32_t tile_box[2] = {128, 128};
    maps.a = make_tensor_map(a, TmaElement::kE4M3, 2, a_dims, a_strides, tile_box, true, "A");
    const int64_t b_dims[3] = {k, n, experts}, b_strides[2] = {k, n * k};
    const int32_t b_box[3] = {128, 128, 1};
    maps.b = make_tensor_map(b, TmaElement::kE4M3, 3, b_dims, b_strides, b_box, true, "B");
    const int64_t s_dims[2] = {rows, k / 128}, s_strides[1] = {rows * 4};
    const int32_t s_box[2] = {128, 1};
    maps.a_scales =
        make_tensor_map(a_scales, TmaElement::kF32, 2, s_dims, s_strides, s_box, false, "A scales");
    maps.out = make_tensor_map_3d(out, n, rows, 1, 64, 128, "out");
    maps.out2 = maps.out;
    params.header = header;
    params.tile_expert = tile_expert;
    params.expert_offsets = expert_offsets;
    params.b_scales = b_scales;
    params.n_extent = static_cast<int32_t>(n);
    params.k_extent = static_cast<int32_t>(k);
    params.wait = test_wait_context();
  }
  // On `ctas` CTAs, or one per SM (0).
  cudaError_t run(cudaStream_t stream = nullptr, int ctas = 0) {
    const cudaError_t status =
        kernels::launch_fp8_grouped_gemm(maps, params, ctas == 0 ? sm_count : ctas, stream);
    if (status != cudaSuccess || params.tile_rows != 192 || params.tile_tickets.counter == nullptr)
      return status;
    ++launches_by_ticket;
    return kernels::launch_advance_epoch(params.tile_tickets.epoch, stream);
  }
  // Each launch by ticket took its tickets from its own epoch's base: the counter's epoch is
  // the last launch's and the epoch counts the launches.
  void expect_ticket_epochs() const {
    unsigned long long words[2] = {0, 0};  // the counter, the epoch
    ASSERT_EQ(cudaMemcpy(words, tickets.counter, sizeof(words), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(words[1], static_cast<unsigned long long>(launches_by_ticket)) << "the epoch";
    EXPECT_EQ(words[0] >> 32, words[1]) << "the counter's epoch";
  }
};

// `problem`'s maps for the 192-row tiles (MoeConfig::fp8_row_tile_rows = 192, as the layer
// makes them): A's codes and the output in 64-row chunks, A's line scales in boxes of 192.
inline kernels::Fp8GemmMaps rows_192_maps(const Fp8GemmProblem& problem) {
  kernels::Fp8GemmMaps maps = problem.maps;
  const int64_t a_dims[2] = {problem.k, problem.rows}, a_strides[1] = {problem.k};
  const int32_t a_box[2] = {128, kernels::kRows192Chunk};
  maps.a = make_tensor_map(problem.a, TmaElement::kE4M3, 2, a_dims, a_strides, a_box, true, "A");
  const int64_t s_dims[2] = {problem.rows, problem.k / 128}, s_strides[1] = {problem.rows * 4};
  const int32_t s_box[2] = {kernels::kRows192, 1};
  maps.a_scales = make_tensor_map(problem.a_scales, TmaElement::kF32, 2, s_dims, s_strides, s_box,
                                  false, "A scales");
  maps.out = maps.out2 = make_tensor_map_3d(problem.out, problem.n, problem.rows, 1, 64,
                                            kernels::kRows192Chunk, "out");
  return maps;
}

// Device buffers, maps and parameters of one weight-gradient problem: per expert e,
// out[e] [m, n] over the expert's rows [offsets[e], offsets[e + 1]) of A [m, rows] and B
// [n, rows] (both column-group codes, scales [rows / 128, m or n]).
struct Fp8WeightGradProblem {
  DeviceAllocations device;  // owns the buffers below
  int64_t rows = 0, m = 0, n = 0, experts = 0;
  void *a_codes = nullptr, *b_codes = nullptr, *out = nullptr;
  float *a_scales = nullptr, *b_scales = nullptr;
  int32_t* offsets = nullptr;
  kernels::Fp8GemmMaps maps{};
  kernels::Fp8GemmParams params{};
  int sm_count = kernels::current_sm_count();  // run()'s grid by default

  Fp8WeightGradProblem(int64_t rows_, int64_t m_, int64_t n_, int64_t experts_)
      : rows(rows_), m(m_), n(n_), experts(experts_) {
    a_codes = device.allocate(m * rows);
    b_codes = device.allocate(n * rows);
    out = device.allocate(experts * m * n * 2);
    a_scales = device.allocate<float>(m * (rows / 128) * 4);
    b_scales = device.allocate<float>(n * (rows / 128) * 4);
    offsets = device.allocate<int32_t>((experts + 1) * 4);
    const int32_t tile_box[2] = {128, 128}, scale_box[2] = {128, 1};
    const int64_t a_dims[2] = {rows, m}, b_dims[2] = {rows, n}, row_strides[1] = {rows};
    maps.a =
        make_tensor_map(a_codes, TmaElement::kE4M3, 2, a_dims, row_strides, tile_box, true, "A");
    maps.b =
        make_tensor_map(b_codes, TmaElement::kE4M3, 2, b_dims, row_strides, tile_box, true, "B");
    const int64_t sa_dims[2] = {m, rows / 128}, sa_strides[1] = {m * 4};
    const int64_t sb_dims[2] = {n, rows / 128}, sb_strides[1] = {n * 4};
    maps.a_scales = make_tensor_map(a_scales, TmaElement::kF32, 2, sa_dims, sa_strides, scale_box,
                                    false, "A scales");
    maps.b_scales = make_tensor_map(b_scales, TmaElement::kF32, 2, sb_dims, sb_strides, scale_box,
                                    false, "B scales");
    maps.out = make_tensor_map_3d(out, n, m, experts, 64, 128, "weight gradients");
    params.form = kernels::Fp8GemmForm::kWeightGrad;
    params.expert_offsets = offsets;
    params.num_experts = static_cast<int32_t>(experts);
    params.m_extent = static_cast<int32_t>(m);
    params.n_extent = static_cast<int32_t>(n);
    params.wait = test_wait_context();
  }
  // On `ctas` CTAs, or one per SM (0).
  cudaError_t run(int ctas = 0) {
    return kernels::launch_fp8_grouped_gemm(maps, params, ctas == 0 ? sm_count : ctas, nullptr);
  }
};

}  // namespace mok::test
