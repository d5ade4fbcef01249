// Host-callable wrappers of the NCCL device-API pieces mok needs (nccl_device_glue.cu), so that
// host C++ files need not include nccl_device.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::comm_detail {

// Ranks of the communicator's LSA team (the GPUs it reaches by load/store over NVLink).
int32_t lsa_team_size(void* comm);

// Writes num_ranks device pointers to `out` (device memory): rank r's buffer of the symmetric
// window `window` (an ncclWindow_t) as this GPU addresses it.
cudaError_t launch_resolve_peer_pointers(void* window, int32_t num_ranks, void** out,
                                         cudaStream_t stream);

}  // namespace mok::comm_detail
