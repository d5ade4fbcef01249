// TMA tensor maps: see tma.h.
#include "layer/tma.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

namespace mok {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult query{};
    cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000,
                                                          cudaEnableDefault, &query);
    if (status != cudaSuccess || query != cudaDriverEntryPointSuccess || pointer == nullptr)
      throw Error(ErrorCode::kCudaError,
                  std::string("cannot get the driver's cuTensorMapEncodeTiled: ") +
                      cudaGetErrorString(status));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pointer);
  }();
  return function;
}

CUtensorMap encode(const void* base, int rank, const cuuint64_t* dims,
                   const cuuint64_t* strides_bytes, const cuuint32_t* box, const char* what,
                   CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                   CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUresult result = encode_function()(
      &map, type, rank, const_cast<void*>(base), dims, strides_bytes, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    std::string extents;
    for (int d = 0; d < rank; ++d) extents += (d ? ", " : "") + std::to_string(dims[d]);
    throw Error(ErrorCode::kCudaError, std::string("cuTensorMapEncodeTiled failed (") +
                                           std::to_string(result) + ") for " + what +
                                           " with extents [" + extents +
                                           "] (innermost first); pointers must be 16-byte aligned");
  }
  return map;
}

// The swizzle of a bf16 box of `box_inner` elements per row: the one whose span is the row's
// bytes, so that each row of the box is one swizzle atom (what the kernels' shared-memory
// layouts assume).
CUtensorMapSwizzle bf16_swizzle(int32_t box_inner, const char* what) {
  switch (box_inner * 2) {
    case 128:
      return CU_TENSOR_MAP_SWIZZLE_128B;
    case 64:
      return CU_TENSOR_MAP_SWIZZLE_64B;
    case 32:
      return CU_TENSOR_MAP_SWIZZLE_32B;
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("tensor map of ") + what +
                      ": box_inner = " + std::to_string(box_inner) +
                      " bf16 elements; valid: 64, 32 or 16 (rows of 128, 64 or 32 bytes, "
                      "one swizzle span)");
  }
}

}  // namespace

CUtensorMap make_tensor_map_2d(const void* base, int64_t inner, int64_t outer, int32_t box_inner,
                               int32_t box_outer, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner),
                             static_cast<cuuint32_t>(box_outer)};
  return encode(base, 2, dims, strides, box, what, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                bf16_swizzle(box_inner, what));
}

CUtensorMap make_tensor_map_3d(const void* base, int64_t inner, int64_t outer, int64_t batch,
                               int32_t box_inner, int32_t box_outer, const char* what,
                               int64_t batch_stride) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer),
                              static_cast<cuuint64_t>(batch)};
  const int64_t entry = batch_stride > 0 ? batch_stride : inner * outer;
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner) * 2,
                                 static_cast<cuuint64_t>(entry) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_outer),
                             1};
  return encode(base, 3, dims, strides, box, what, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                bf16_swizzle(box_inner, what));
}

CUtensorMap make_tensor_map(const void* base, TmaElement element, int rank, const int64_t* dims,
                            const int64_t* strides_bytes, const int32_t* box, bool swizzle_128b,
                            const char* what, TmaL2Promotion promotion) {
  if (rank < 1 || rank > 3)
    throw Error(ErrorCode::kInvalidArgument, std::string("make_tensor_map: rank = ") +
                                                 std::to_string(rank) + " for " + what +
                                                 "; valid: 1, 2 or 3");
  cuuint64_t dims_u[3], strides_u[2];
  cuuint32_t box_u[3];
  for (int d = 0; d < rank; ++d) {
    dims_u[d] = static_cast<cuuint64_t>(dims[d]);
    box_u[d] = static_cast<cuuint32_t>(box[d]);
    if (d > 0) strides_u[d - 1] = static_cast<cuuint64_t>(strides_bytes[d - 1]);
  }
  const CUtensorMapDataType type = element == TmaElement::kBF16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : element == TmaElement::kE4M3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                                  : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const CUtensorMapL2promotion l2 =
      promotion == TmaL2Promotion::kNone   ? CU_TENSOR_MAP_L2_PROMOTION_NONE
      : promotion == TmaL2Promotion::k128B ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                           : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  return encode(base, rank, dims_u, strides_u, box_u, what, type,
                swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, l2);
}

}  // namespace mok
