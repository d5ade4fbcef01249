// The types of device waits that host code also sees: the context every waiting kernel gets,
// and the diagnosis record a timed-out wait leaves behind (see wait.cuh).
#pragma once

#include <stdint.h>

namespace mok::kernels {

// What was being waited for; the host turns it into words (describe_wait_diagnosis in
// wait_report.h).
enum class WaitSite : int32_t {
  kGemmFreeStage = 1,      // GEMM producer waiting for consumers to release a smem stage
  kGemmLoadedStage = 2,    // GEMM consumer waiting for TMA to fill a smem stage
  kCounter = 3,            // a dependency counter in global memory
  kTestNeverReady = 4,     // the deliberately unsatisfiable wait of the timeout test
  kGatheredRows = 5,       // GEMM producer waiting for a row tile's rows to be gathered
  kTaskQueueSlot = 6,      // persistent scheduler waiting for a free slot of the CTA's task queue
  kQueuedTask = 7,         // persistent consumer waiting for its next task
  kGateUpDone = 8,         // persistent scheduler: a down tile waiting for its row tile's gate/up
  kPeerSignal = 9,         // a rank waiting for another rank's signal (peer_barrier.cuh)
  kBulkRow = 10,           // a bulk row copy's load into shared memory (bulk_rows.cuh)
  kRowGemmsDone = 11,      // persistent backward: a SwiGLU task waiting for its row tile's GEMMs
  kSwigluDone = 12,        // persistent backward: a gate/up dgrad tile waiting for its SwiGLU task
  kExpertReady = 13,       // persistent backward: a weight-gradient tile waiting for its expert
  kSharedGateUpDone = 14,  // persistent forward: a shared-expert down tile waiting for its gate/up
  kLockstep = 15,          // GEMM producer waiting for the slowest CTA (gemm_lockstep_k_blocks)
  kStagingFree = 16,       // FP8 weight-gradient consumer waiting for the staging tile's last store
                           // (accumulating: for its old values' load)
  kStagingFull = 17,       // FP8 weight-gradient storer waiting for the consumers' staged tile
  kEpilogueLoaded = 18,    // down dgrad + SwiGLU consumer waiting for a subtile's g and u (TMA)
  kEpilogueFree = 19,      // down dgrad + SwiGLU loader waiting for a subtile's stores to read it
  kEpilogueWritten = 20,   // down dgrad + SwiGLU storer waiting for the consumers' subtile
  kTileRingSlot = 21,   // 192-row FP8 GEMM scheduler waiting for its tile ring's entry to be read
  kScheduledTile = 22,  // 192-row FP8 GEMM producer or consumer waiting for its next tile
};

// Where a timed-out wait leaves its diagnosis: host memory mapped into the device, so the host
// can still read it after the abort's memory fault has killed the context.
struct WaitDiagnosis {
  int32_t timed_out;  // 1 once written
  int32_t site;       // WaitSite
  int32_t rank;
  int32_t sm;
  int32_t block;
  int32_t thread;
  int64_t expected;
  int64_t seen;
  uint64_t waited_ns;
};

// Passed by value to every kernel that waits.
struct WaitContext {
  uint64_t timeout_ns;  // from MoeConfig::wait_timeout_s
  int32_t rank;
  WaitDiagnosis* diagnosis;  // mapped host memory, or null
};

}  // namespace mok::kernels
