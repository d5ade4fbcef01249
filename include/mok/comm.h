// The expert-parallel group over NCCL (DESIGN.md §2, §2.8): communicators, symmetric memory and
// the peer pointers the dispatch / combine kernels write through. Built when NCCL is found
// (MOK_HAS_NCCL); NCCL types stay out of this header.
//
// Two ways to form a group of N GPUs:
//   - one process driving all of them: Communicator::create_all (ncclCommInitAll);
//   - one process per GPU: Communicator::create_rank from a unique id that every rank received
//     (bootstrap.h exchanges it through a file; the Python layer will use its process group).
// Symmetric memory (SymmetricMemory): each rank gets device memory from ncclMemAlloc,
// registered as an NCCL window with NCCL_WIN_COLL_SYMMETRIC; NCCL maps every rank's buffer
// into each GPU's address space over NVLink (the LSA team), and peer(r) is rank r's buffer as
// this GPU addresses it. Every rank must be in one NVLink domain (one LSA team): construction
// refuses otherwise, naming the team size. NVLink multicast is never used.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mok/bootstrap.h"

namespace mok {

class Communicator {
 public:
  // Rank i of the group drives devices[i]. All in this process; returns them in rank order.
  static std::vector<std::unique_ptr<Communicator>> create_all(const std::vector<int>& devices);
  // This process's rank of `num_ranks`, on CUDA device `device`. Blocks until every rank joined.
  static std::unique_ptr<Communicator> create_rank(const UniqueId& id, int32_t num_ranks,
                                                   int32_t rank, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int32_t rank() const { return rank_; }
  int32_t num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  void* nccl_handle() const { return comm_; }  // ncclComm_t

 private:
  Communicator(void* comm, int32_t rank, int32_t num_ranks, int device);
  void* comm_;
  int32_t rank_, num_ranks_;
  int device_;
};

// A symmetric allocation: one buffer of the same size on every rank of the group, each rank's
// buffer addressable from every GPU. Construction and destruction are collective over the group:
// every process makes the same allocations in the same order, each passing the group's ranks it
// drives (all of them after create_all, its one rank after create_rank); registration and
// deregistration of this process's ranks are one NCCL group call.
class SymmetricMemory {
 public:
  // With zero_fill every rank's buffer is zero before any rank's construction returns (each
  // rank zeroes its buffer before the collective registration, which completes only once every
  // rank joined it): what flag arrays need.
  SymmetricMemory(const std::vector<Communicator*>& ranks_here, int64_t bytes, const char* what,
                  bool zero_fill = false);
  ~SymmetricMemory();
  SymmetricMemory(const SymmetricMemory&) = delete;
  SymmetricMemory& operator=(const SymmetricMemory&) = delete;

  int64_t bytes() const { return bytes_; }  // rounded up to whole 2 MiB pages
  // Pieces of this process, in the order of ranks_here.
  int32_t num_pieces() const { return static_cast<int32_t>(pieces_.size()); }
  const Communicator& communicator(int32_t piece) const { return *pieces_.at(piece).communicator; }
  void* local(int32_t piece) const { return pieces_.at(piece).local; }
  // Rank r's buffer as piece `piece`'s GPU addresses it (for r = its own rank: the same memory
  // as local(piece), possibly at another address).
  void* peer(int32_t piece, int32_t rank) const { return pieces_.at(piece).peers.at(rank); }
  // The same pointers as a device array of num_ranks entries on piece `piece`'s GPU.
  void* const* device_peers(int32_t piece) const { return pieces_.at(piece).device_peers; }

 private:
  struct Piece {
    Communicator* communicator = nullptr;
    void* local = nullptr;
    void* window = nullptr;  // ncclWindow_t
    std::vector<void*> peers;
    void** device_peers = nullptr;
  };
  void release();
  std::vector<Piece> pieces_;
  int64_t bytes_ = 0;
  std::string what_;
};

}  // namespace mok
