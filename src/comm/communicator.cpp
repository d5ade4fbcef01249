// Communicators and symmetric buffers over NCCL: see include/mok/comm.h.
#include <nccl.h>

#include <cstring>
#include <string>

#include "comm/nccl_glue.h"
#include "kernels/common/kernel_preload.h"
#include "layer/cuda_buffer.h"
#include "mok/comm.h"
#include "mok/error.h"

namespace mok {

namespace {

// Throws mok::Error(kCommError) naming the call, NCCL's reason and, where NCCL left one, its
// last message.
void nccl_check(ncclResult_t result, const std::string& what, ncclComm_t comm = nullptr) {
  if (result == ncclSuccess) return;
  std::string message = what + " failed: " + ncclGetErrorString(result);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0') message += " (" + std::string(detail) + ")";
  throw Error(ErrorCode::kCommError, message);
}

// Symmetric buffers are allocated and registered in whole 2 MiB pages (the granularity of the
// CUDA virtual-memory allocations NCCL maps across the group), the same size on every rank.
int64_t round_up_to_granularity(int64_t bytes) {
  constexpr int64_t kGranularity = int64_t{2} << 20;
  return (bytes + kGranularity - 1) / kGranularity * kGranularity;
}

void check_group_size(int32_t num_ranks, const char* where) {
  if (num_ranks < 1)
    throw Error(ErrorCode::kInvalidArgument, std::string(where) + ": the group has " +
                                                 std::to_string(num_ranks) +
                                                 " ranks; valid: at least 1");
}

// Loads every mok kernel on `device` (kernel_preload.h: a lazy load while a peer-waiting kernel
// runs could deadlock a process that drives several GPUs).
void preload_kernels_on(int device) {
  DeviceScope guard(device);
  const char* failed_file = "";
  const cudaError_t status = kernels::preload_kernels(&failed_file);
  if (status != cudaSuccess)
    throw Error(ErrorCode::kCudaError, "loading the kernels of " + std::string(failed_file) +
                                           " on device " + std::to_string(device) + ": " +
                                           cudaGetErrorString(status));
}

}  // namespace

Communicator::Communicator(void* comm, int32_t rank, int32_t num_ranks, int device)
    : comm_(comm), rank_(rank), num_ranks_(num_ranks), device_(device) {
  try {
    preload_kernels_on(device);
  } catch (...) {
    ncclCommDestroy(static_cast<ncclComm_t>(comm));
    throw;
  }
}

Communicator::~Communicator() {
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

std::vector<std::unique_ptr<Communicator>> Communicator::create_all(
    const std::vector<int>& devices) {
  const int32_t num_ranks = static_cast<int32_t>(devices.size());
  check_group_size(num_ranks, "Communicator::create_all");
  int device_count = 0;
  cuda_check(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
  for (int32_t rank = 0; rank < num_ranks; ++rank)
    if (devices[rank] < 0 || devices[rank] >= device_count)
      throw Error(ErrorCode::kInvalidArgument,
                  "Communicator::create_all: devices[" + std::to_string(rank) +
                      "] = " + std::to_string(devices[rank]) + "; valid: [0, " +
                      std::to_string(device_count) + ") on this machine");
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  nccl_check(ncclCommInitAll(comms.data(), num_ranks, devices.data()),
             "ncclCommInitAll over " + std::to_string(num_ranks) + " GPUs");
  std::vector<std::unique_ptr<Communicator>> group;
  for (int32_t rank = 0; rank < num_ranks; ++rank)
    group.push_back(std::unique_ptr<Communicator>(
        new Communicator(comms[rank], rank, num_ranks, devices[rank])));
  return group;
}

std::unique_ptr<Communicator> Communicator::create_rank(const UniqueId& id, int32_t num_ranks,
                                                        int32_t rank, int device) {
  check_group_size(num_ranks, "Communicator::create_rank");
  if (rank < 0 || rank >= num_ranks)
    throw Error(ErrorCode::kInvalidArgument,
                "Communicator::create_rank: rank = " + std::to_string(rank) + "; valid: [0, " +
                    std::to_string(num_ranks) + ")");
  DeviceScope guard(device);
  ncclUniqueId nccl_id;
  static_assert(sizeof(nccl_id) == sizeof(id.bytes), "ncclUniqueId size changed");
  std::memcpy(&nccl_id, id.bytes.data(), sizeof(nccl_id));
  ncclComm_t comm = nullptr;
  nccl_check(
      ncclCommInitRank(&comm, num_ranks, nccl_id, rank),
      "ncclCommInitRank (rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) + ")");
  return std::unique_ptr<Communicator>(new Communicator(comm, rank, num_ranks, device));
}

SymmetricMemory::SymmetricMemory(const std::vector<Communicator*>& ranks_here, int64_t bytes,
                                 const char* what, bool zero_fill)
    : bytes_(round_up_to_granularity(bytes)), what_(what) {
  if (bytes <= 0)
    throw Error(ErrorCode::kInvalidArgument, "SymmetricMemory (" + what_ + "): bytes = " +
                                                 std::to_string(bytes) + "; valid: positive");
  if (ranks_here.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "SymmetricMemory (" + what_ + "): no ranks given; pass this process's ranks");
  try {
    for (Communicator* communicator : ranks_here) {
      const int32_t team = comm_detail::lsa_team_size(communicator->nccl_handle());
      if (team != communicator->num_ranks())
        throw Error(ErrorCode::kUnsupported,
                    "SymmetricMemory (" + what_ + "): rank " +
                        std::to_string(communicator->rank()) + " reaches " + std::to_string(team) +
                        " of the group's " + std::to_string(communicator->num_ranks()) +
                        " GPUs over NVLink (its LSA team); mok's expert-parallel group must be "
                        "one NVLink domain");
      Piece piece;
      piece.communicator = communicator;
      DeviceScope guard(communicator->device());
      nccl_check(ncclMemAlloc(&piece.local, static_cast<size_t>(bytes_)),
                 "ncclMemAlloc of " + std::to_string(bytes) + " bytes for " + what_,
                 static_cast<ncclComm_t>(communicator->nccl_handle()));
      pieces_.push_back(std::move(piece));
      if (zero_fill) {
        cuda_check(cudaMemset(pieces_.back().local, 0, static_cast<size_t>(bytes_)),
                   "zeroing " + what_);
        cuda_check(cudaDeviceSynchronize(), "zeroing " + what_);
      }
    }
    // Registration is collective: one group call for the ranks of this process. Inside a group
    // NCCL writes the window handle at ncclGroupEnd, so it must be given the handle's final home
    // (pieces_ does not grow from here on), never a local that is gone by then.
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t result = ncclSuccess;
    for (Piece& piece : pieces_) {
      DeviceScope guard(piece.communicator->device());
      result = ncclCommWindowRegister(static_cast<ncclComm_t>(piece.communicator->nccl_handle()),
                                      piece.local, static_cast<size_t>(bytes_),
                                      reinterpret_cast<ncclWindow_t*>(&piece.window),
                                      NCCL_WIN_COLL_SYMMETRIC);
      if (result != ncclSuccess) break;
    }
    const ncclResult_t end = ncclGroupEnd();
    nccl_check(result, "ncclCommWindowRegister for " + what_);
    nccl_check(end, "ncclGroupEnd after registering " + what_);
    for (const Piece& piece : pieces_)
      if (piece.window == nullptr)
        throw Error(ErrorCode::kCommError, "ncclCommWindowRegister for " + what_ + " on rank " +
                                               std::to_string(piece.communicator->rank()) +
                                               " returned success but no window");
    for (Piece& piece : pieces_) {
      const int32_t num_ranks = piece.communicator->num_ranks();
      DeviceScope guard(piece.communicator->device());
      cuda_check(
          cudaMalloc(reinterpret_cast<void**>(&piece.device_peers), sizeof(void*) * num_ranks),
          "peer pointer table for " + what_);
      // A group of one has no peers: its only pointer is its own buffer (NCCL's device-side
      // window lookup faulted with one rank on one H200: an illegal address in the kernel).
      if (num_ranks == 1)
        cuda_check(
            cudaMemcpy(piece.device_peers, &piece.local, sizeof(void*), cudaMemcpyHostToDevice),
            "peer pointer table for " + what_);
      else
        cuda_check(comm_detail::launch_resolve_peer_pointers(piece.window, num_ranks,
                                                             piece.device_peers, nullptr),
                   "resolving the peer pointers of " + what_);
      piece.peers.assign(static_cast<size_t>(num_ranks), nullptr);
      cuda_check(cudaMemcpy(piece.peers.data(), piece.device_peers, sizeof(void*) * num_ranks,
                            cudaMemcpyDeviceToHost),
                 "reading the peer pointers of " + what_);
    }
  } catch (...) {
    release();
    throw;
  }
}

// Collective like the constructor; never throws (it runs in the destructor).
void SymmetricMemory::release() {
  int previous_device = 0;
  cudaGetDevice(&previous_device);
  bool registered = false;
  for (const Piece& piece : pieces_) registered |= piece.window != nullptr;
  if (registered) {
    ncclGroupStart();
    for (Piece& piece : pieces_) {
      if (piece.window == nullptr) continue;
      cudaSetDevice(piece.communicator->device());
      ncclCommWindowDeregister(static_cast<ncclComm_t>(piece.communicator->nccl_handle()),
                               static_cast<ncclWindow_t>(piece.window));
      piece.window = nullptr;
    }
    ncclGroupEnd();
  }
  for (Piece& piece : pieces_) {
    cudaSetDevice(piece.communicator->device());
    if (piece.device_peers != nullptr) cudaFree(piece.device_peers);
    if (piece.local != nullptr) ncclMemFree(piece.local);
    piece.device_peers = nullptr;
    piece.local = nullptr;
  }
  cudaSetDevice(previous_device);
}

SymmetricMemory::~SymmetricMemory() { release(); }

}  // namespace mok
