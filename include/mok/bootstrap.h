// Bootstrapping an expert-parallel group of processes (one per GPU): rank 0 creates the NCCL
// unique id and every rank must receive it before it can join the communicator. mok passes it
// through a file every rank can see (a local directory for one node, a shared filesystem for
// several); the Python layer will pass it through the caller's process group instead.
//
// Protocol: rank 0 writes `path` + ".tmp" and renames it to `path` (rename is atomic, so a
// reader never sees a half-written file); the other ranks poll for `path` until a timeout. The
// file records the group size, which every reader checks. Use a fresh path per job: rank 0
// refuses to overwrite an existing file, since another job's id would make the ranks hang.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace mok {

// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128), kept opaque here so that this
// header does not need nccl.h.
struct UniqueId {
  std::array<char, 128> bytes{};
};

// A fresh id from NCCL (ncclGetUniqueId). Throws mok::Error(kInternal) naming NCCL's error.
UniqueId make_unique_id();

// Rank 0's side: writes the id and the group size to `path`. Throws mok::Error naming the path
// if it already exists or cannot be written.
void publish_unique_id(const std::string& path, const UniqueId& id, int32_t num_ranks);

// The other ranks' side: waits up to `timeout_s` for `path`, checks its format and group size.
// Throws mok::Error(kTimeout) naming the path and the time waited, or kInvalidArgument for a
// file of another group size or format.
UniqueId wait_for_unique_id(const std::string& path, int32_t num_ranks, double timeout_s);

// Both sides in one call: rank 0 makes and publishes the id, the others wait for it.
UniqueId exchange_unique_id(const std::string& path, int32_t rank, int32_t num_ranks,
                            double timeout_s);

}  // namespace mok
