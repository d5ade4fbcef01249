// GPU builder of the routing schedule (layout and contract in mok/schedule.h).
#pragma once

#include <cuda_runtime_api.h>

#include "mok/schedule.h"

namespace mok {

// Builds the schedule of `layout.params.local_rank` on `stream` from the gathered routing
// `top_experts_all` ([R, T, K] int32 or int64, device memory). `buffer` is device memory of
// layout.total_bytes. Four small kernels, no host synchronization, capturable in a CUDA graph;
// every output array is fully rewritten on each launch, so no reset pass is needed.
// Returns an error only for bad arguments or a failed launch; bad expert ids are reported in
// the header (read it back and call schedule_status).
Status launch_build_schedule(const ScheduleLayout& layout, const void* top_experts_all,
                             DType expert_dtype, void* buffer, cudaStream_t stream);

}  // namespace mok
