// Unique-id exchange through a file: see include/mok/bootstrap.h.
#include "mok/bootstrap.h"

#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "mok/error.h"

namespace mok {

namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "ncclUniqueId size changed");

constexpr char kMagic[8] = {'m', 'o', 'k', 'u', 'i', 'd', '1', '\n'};

// File layout: magic, int32 group size, the id bytes.
constexpr size_t kFileBytes = sizeof(kMagic) + sizeof(int32_t) + sizeof(UniqueId::bytes);

}  // namespace

UniqueId make_unique_id() {
  ncclUniqueId nccl_id;
  const ncclResult_t result = ncclGetUniqueId(&nccl_id);
  if (result != ncclSuccess)
    throw Error(ErrorCode::kInternal,
                std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(result));
  UniqueId id;
  std::memcpy(id.bytes.data(), &nccl_id, sizeof(nccl_id));
  return id;
}

void publish_unique_id(const std::string& path, const UniqueId& id, int32_t num_ranks) {
  namespace fs = std::filesystem;
  if (fs::exists(path))
    throw Error(ErrorCode::kInvalidArgument,
                "bootstrap: '" + path +
                    "' already exists (left by an earlier job?); remove it or " +
                    "pass a fresh path, since ranks reading an old id would never meet");
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(kMagic, sizeof(kMagic));
    out.write(reinterpret_cast<const char*>(&num_ranks), sizeof(num_ranks));
    out.write(id.bytes.data(), static_cast<std::streamsize>(id.bytes.size()));
    if (!out)
      throw Error(ErrorCode::kInvalidArgument,
                  "bootstrap: cannot write '" + temporary + "' (is its directory writable?)");
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error)
    throw Error(ErrorCode::kInvalidArgument, "bootstrap: cannot rename '" + temporary + "' to '" +
                                                 path + "': " + error.message());
}

UniqueId wait_for_unique_id(const std::string& path, int32_t num_ranks, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto poll_interval = std::chrono::milliseconds(1);
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      char magic[sizeof(kMagic)];
      int32_t file_ranks = 0;
      UniqueId id;
      in.read(magic, sizeof(magic));
      in.read(reinterpret_cast<char*>(&file_ranks), sizeof(file_ranks));
      in.read(id.bytes.data(), static_cast<std::streamsize>(id.bytes.size()));
      if (!in || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0)
        throw Error(ErrorCode::kInvalidArgument,
                    "bootstrap: '" + path + "' is not a mok unique-id file (expected " +
                        std::to_string(kFileBytes) + " bytes starting with 'mokuid1')");
      if (file_ranks != num_ranks)
        throw Error(ErrorCode::kInvalidArgument,
                    "bootstrap: '" + path + "' was written for a group of " +
                        std::to_string(file_ranks) + " ranks; this rank expects " +
                        std::to_string(num_ranks) + " (another job's file?)");
      return id;
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited > timeout_s)
      throw Error(ErrorCode::kTimeout, "bootstrap: waited " + std::to_string(waited) +
                                           " s for rank 0 to publish '" + path +
                                           "'; is rank 0 running, and does it see the same path?");
    std::this_thread::sleep_for(poll_interval);
    poll_interval = std::min(poll_interval * 2, std::chrono::milliseconds(50));
  }
}

UniqueId exchange_unique_id(const std::string& path, int32_t rank, int32_t num_ranks,
                            double timeout_s) {
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks)
    throw Error(ErrorCode::kInvalidArgument,
                "bootstrap: rank = " + std::to_string(rank) +
                    ", num_ranks = " + std::to_string(num_ranks) +
                    "; valid: num_ranks >= 1 and 0 <= rank < num_ranks");
  if (rank == 0) {
    const UniqueId id = make_unique_id();
    publish_unique_id(path, id, num_ranks);
    return id;
  }
  return wait_for_unique_id(path, num_ranks, timeout_s);
}

}  // namespace mok
