// The few places mok touches NCCL's device API (nccl_device.h, built against the same NCCL as
// the library it links, MOK_NCCL_HOME): the LSA team of a communicator, and the peer pointers
// of a symmetric window, resolved once per buffer so that mok's kernels address peers with
// plain pointers.
#include <nccl.h>
#include <nccl_device.h>

#include "comm/nccl_glue.h"
#include "kernels/common/kernel_preload.h"

namespace mok::comm_detail {

namespace {

// out[r] = rank r's buffer of `window` as this GPU addresses it (one NVLink domain: the LSA
// team is the whole group, so world rank r is LSA rank r).
__global__ void resolve_peer_pointers_kernel(ncclWindow_t window, int32_t num_ranks, void** out) {
  const int32_t rank = static_cast<int32_t>(threadIdx.x);
  if (rank < num_ranks) out[rank] = ncclGetPeerPointer(window, 0, rank);
}

}  // namespace

int32_t lsa_team_size(void* comm) { return ncclTeamLsa(static_cast<ncclComm_t>(comm)).nRanks; }

cudaError_t launch_resolve_peer_pointers(void* window, int32_t num_ranks, void** out,
                                         cudaStream_t stream) {
  resolve_peer_pointers_kernel<<<1, 32 * ((num_ranks + 31) / 32), 0, stream>>>(
      static_cast<ncclWindow_t>(window), num_ranks, out);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const kernels::KernelPreloadList kPreload("nccl_device_glue.cu",
                                          {kernels::kernel_symbol(&resolve_peer_pointers_kernel)});
}  // namespace

}  // namespace mok::comm_detail
