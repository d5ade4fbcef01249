// How fast this GPU streams a shape's expert weights in the order and granularity the expert
// GEMMs read them (`mok stream-bench`): TMA loads only, no math, one CTA per SM. It gives the
// memory roofline of the weight-streaming shapes (`dsv3_e128`, `dsv3`: one or two row tiles per
// expert, so each weight tile is read from HBM for at most two CTAs) for the access patterns a
// GEMM could use, beside a contiguous read of the same bytes; paced (each stage held as long
// as a K-block's math) and L2-resident (a few tiles re-read by many CTAs) variants model the
// GEMMs' own conditions.
#pragma once

#include <cstdint>
#include <string>

#include "mok/shape.h"

namespace mok {

// Streams the shape's gate/up weights ([E, 2I, H], K = H) and down weights ([E, H, I], K = I)
// with every access pattern and ring depth, prints the table (TB/s of weight bytes, median of
// 5 passes) to stdout and returns 0. It first runs stream_bench_self_check and throws
// mok::Error (kInternal) if that fails. Needs about 2 x the shape's weight bytes of GPU memory.
int run_stream_bench(const MoeShape& shape);

// The benchmark's own check: every pattern and ring depth, on a small tensor filled with a hash
// of each 32-bit word's index, sums the words that land in shared memory; each word must be
// summed exactly once per reader. Returns an empty string when all agree, else what differed.
std::string stream_bench_self_check();

}  // namespace mok
