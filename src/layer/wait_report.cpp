// describe_wait_diagnosis: see wait_report.h.
#include "layer/wait_report.h"

namespace mok {

namespace {

const char* wait_site_name(int32_t site) {
  switch (static_cast<kernels::WaitSite>(site)) {
    case kernels::WaitSite::kGemmFreeStage:
      return "GEMM producer waiting for a free shared-memory stage";
    case kernels::WaitSite::kGemmLoadedStage:
      return "GEMM consumer waiting for a loaded shared-memory stage";
    case kernels::WaitSite::kCounter:
      return "a dependency counter";
    case kernels::WaitSite::kGatheredRows:
      return "GEMM producer waiting for the rows of a row tile to be gathered (fused local "
             "dispatch)";
    case kernels::WaitSite::kTaskQueueSlot:
      return "persistent forward scheduler waiting for a free slot of its CTA's task queue";
    case kernels::WaitSite::kQueuedTask:
      return "persistent forward consumer waiting for its next task";
    case kernels::WaitSite::kGateUpDone:
      return "persistent forward down tile waiting for every gate/up tile of its row tile "
             "(expected and seen count tiles)";
    case kernels::WaitSite::kSharedGateUpDone:
      return "persistent forward shared-expert down tile waiting for every shared gate/up tile "
             "of its row tile (expected and seen count tiles)";
    case kernels::WaitSite::kPeerSignal:
      return "a signal from another GPU of the expert-parallel group (is every rank running "
             "the same layer call?; expected and seen are epochs)";
    case kernels::WaitSite::kBulkRow:
      return "a bulk row copy waiting for its row to arrive in shared memory";
    case kernels::WaitSite::kRowGemmsDone:
      return "persistent backward SwiGLU task waiting for the down dgrad (and recompute) tiles "
             "of its row tile (expected and seen count tiles)";
    case kernels::WaitSite::kSwigluDone:
      return "persistent backward gate/up dgrad tile waiting for the SwiGLU task of its row tile";
    case kernels::WaitSite::kExpertReady:
      return "persistent backward weight-gradient tile waiting for the SwiGLU tasks of its "
             "expert's row tiles (expected and seen count row tiles)";
    case kernels::WaitSite::kLockstep:
      return "expert GEMM producer waiting for the slowest CTA of its launch to catch up "
             "(gemm_lockstep_k_blocks; expected counts the CTAs started, seen those past the "
             "tick)";
    case kernels::WaitSite::kStagingFree:
      return "FP8 weight-gradient consumer waiting for the store of the staging tile's last tile "
             "to have read it (accumulated gradients: for the tile's old values to be loaded "
             "there)";
    case kernels::WaitSite::kStagingFull:
      return "FP8 weight-gradient storer waiting for the consumer warps to stage their tile "
             "(expected and seen are the barrier's phase)";
    case kernels::WaitSite::kEpilogueLoaded:
      return "down dgrad + SwiGLU consumer waiting for the TMA loads of a subtile's g and u "
             "(expected and seen are the barrier's phase)";
    case kernels::WaitSite::kEpilogueFree:
      return "down dgrad + SwiGLU loader waiting for a subtile buffer's stores to have read it "
             "(expected and seen are the barrier's phase)";
    case kernels::WaitSite::kEpilogueWritten:
      return "down dgrad + SwiGLU storer waiting for the consumer warps to write a subtile "
             "(expected and seen are the barrier's phase)";
    case kernels::WaitSite::kTileRingSlot:
      return "192-row FP8 GEMM scheduler waiting for the producer and the consumer warps to read "
             "an entry of its tile ring (expected and seen are the barrier's phase)";
    case kernels::WaitSite::kScheduledTile:
      return "192-row FP8 GEMM producer or consumer waiting for its scheduler's next tile "
             "(expected and seen are the barrier's phase)";
    case kernels::WaitSite::kTestNeverReady:
      return "the test's never-ready condition";
  }
  return "an unknown wait site";
}

}  // namespace

std::string describe_wait_diagnosis(const kernels::WaitDiagnosis& record) {
  return "device wait timed out after " +
         std::to_string(static_cast<double>(record.waited_ns) * 1e-9) + " s: rank " +
         std::to_string(record.rank) + ", SM " + std::to_string(record.sm) + ", block " +
         std::to_string(record.block) + ", thread " + std::to_string(record.thread) + ", " +
         wait_site_name(record.site) + " (expected " + std::to_string(record.expected) + ", seen " +
         std::to_string(record.seen) + "); the kernel was aborted";
}

}  // namespace mok
