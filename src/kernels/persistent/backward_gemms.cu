// The persistent backward kernel: every task of the routed experts' backward in one launch, in
// the order of backward_task_order.h, with dependency counters instead of kernel boundaries
// (DESIGN.md §2.5, §2.7). The rows (d_out, and x for the recompute) are gathered by the spare
// producer warps during the launch (the forward's fused local dispatch, dispatch_local.cuh), or
// before it (expert parallel: expanded from the received rows); the rows(m) tickets are skipped
// either way. The fixed-order d_x combine runs after the launch, so the plan has no combine
// tasks; one macrobatch (the layer runs the kernel sequence otherwise). With a shared expert
// (params.num_sets = 2) its tasks run in the same ticket stream, merged into the routed order
// (backward_task_order.h), on its own maps, parameters and counters: a queued task names its set.
//
// Grid: persistent, one 384-thread CTA per SM (or fewer resident: see Progress).
// Warp roles (the mainloop, the loads and the epilogues are the expert GEMM's:
// gemm_mainloop.cuh, gemm_loads.cuh, epilogue.cuh):
//   warpgroup 0, thread 0  the scheduler and TMA thread. Per task: takes a ticket from the
//                global counter (the next one before issuing the current task's loads), maps it
//                to a task (backward_task_at with a cursor: this CTA's tickets only grow, and
//                the cursor keeps what is costly to recompute), waits for the task's
//                dependency, publishes the task in a 4-slot shared-memory queue
//                (task_queue.cuh), then issues the task's loads into the 3-stage ring: a GEMM
//                tile's K-blocks, or a SwiGLU task's row blocks (swiglu_backward_task.cuh).
//                After the last ticket it publishes a stop task.
//   warpgroup 0, warps 1-3 gather the rows (d_out_gather, x_gather: a global ticket per row, a
//                count per 128-row tile), then exit.
//   warpgroups 1, 2        consumers: read the task from the queue and run it:
//                recompute(m, n)      mainloop + kGateUpStore epilogue (bf16 g, u)
//                down_dgrad(m, n)     mainloop + kDownGrad epilogue (dh_raw)
//                swiglu(m)            the eight consumer warps run the SwiGLU backward of the
//                                     row tile's 128 rows from the stages (d_g, d_u, h_w in
//                                     place of dh_raw, the router-weight gradients)
//                gate_up_dgrad(m, n)  mainloop + kGateUpGradStore epilogue (the dx rows)
//                wgrad(e, matrix, t)  mainloop over expert e's rows + kWeightGrad epilogue
// Dependencies (counters in global memory, epoch * kGateUpDoneStride + count):
//   swiglu(m)          row_gemms_done[m] = its down dgrad tiles (+ recompute tiles)
//   gate_up_dgrad(m,n) swiglu_done[m] = 1
//   wgrad(e, ...)      expert_ready[e] = the number of e's row tiles (none for an empty expert)
// Ordering: a GEMM tile's output leaves by TMA stores; the first consumer thread waits for them
// to complete, fences the async proxy and release-adds the counter; the waiting side (the
// scheduler, before it queues the task) acquires and fences the async proxy before its TMA
// loads. The SwiGLU task's generic stores: each thread fences (device scope, and toward the
// async proxy: its readers load with TMA), the eight warps meet at a named barrier, then one
// thread release-adds.
// Progress: a ticket is taken only by a running scheduler, and a task waits only on tasks with
// smaller tickets, which were all queued (and their loads issued) before their scheduler took
// its next ticket; so the kernel finishes with any number of resident CTAs.
// Epochs: the ticket and the counters only grow; nothing is reset (graph replays work).
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_loads.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/persistent/backward_task_order.h"
#include "kernels/persistent/launch.h"
#include "kernels/persistent/swiglu_backward_task.cuh"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/persistent/task_trace.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

namespace {

// The named barrier of the SwiGLU task's consumer warps (1: the consumers' staging tile).
constexpr int kSwigluBarrier = 2;

// A task as the consumers need it.
struct QueuedTask {
  int32_t kind;  // BackwardTaskKind, or kStopTask
  int32_t set;   // 0 the routed experts, 1 the shared expert
  int32_t m_tile;
  int32_t n_tile;
  int32_t expert;  // the row tile's expert, or the weight gradient's
  int32_t matrix;  // wgrad: 0 gate, 1 up, 2 down
  int32_t k_row0;  // wgrad: the expert's first row
  int32_t num_k_blocks;
  int32_t ticket;  // for the task trace
};

using Storage = GemmSharedStorage<kNumStages>;

__device__ __forceinline__ unsigned long long launch_epoch(const BackwardGemmsParams& params) {
  return *reinterpret_cast<const volatile unsigned long long*>(params.epoch) + 1;
}

// The plan of one expert set; `expert_tiles` (shared memory, E + 1 entries) holds each
// expert's first row tile.
__device__ __forceinline__ BackwardPlan plan_of(const BackwardSetParams& params,
                                                const int32_t* expert_tiles) {
  const int32_t I = params.down_dgrad.n_extent, H = params.gate_up_dgrad.n_extent;
  BackwardPlan plan;
  plan.num_m_tiles = params.down_dgrad.header->num_tiles;
  plan.minibatch_tiles = params.minibatch_tiles;
  plan.recompute = params.recompute_rows;
  plan.gate_up_n_tiles = (I + 127) / 128;
  plan.down_dgrad_n_tiles = (I + BLOCK_N - 1) / BLOCK_N;
  plan.gate_up_dgrad_n_tiles = (H + BLOCK_N - 1) / BLOCK_N;
  plan.gate_wgrad_tiles = ((I + BLOCK_M - 1) / BLOCK_M) * ((H + BLOCK_N - 1) / BLOCK_N);
  plan.down_wgrad_tiles = ((H + BLOCK_M - 1) / BLOCK_M) * ((I + BLOCK_N - 1) / BLOCK_N);
  plan.num_experts = params.down_dgrad.num_experts;
  plan.combine_blocks = 0;
  plan.expert_tiles = expert_tiles;
  return plan;
}

// What the consumers need of `task`: coordinates, the expert, and the K blocks. From shared
// memory only (the plan's expert_tiles): a global load here would sit between two tasks' loads
// on the scheduler's critical path.
__device__ __forceinline__ QueuedTask queued_task(const BackwardSetParams& params,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task) {
  QueuedTask queued{
      static_cast<int32_t>(task.kind), task.set, task.m_tile, task.n_tile, -1, -1, 0, 0, -1};
  if (task.kind == BackwardTaskKind::kWeightGrad) {
    // Weight tile index -> (m, n) as the standalone kernel walks them; K = the expert's rows.
    const ExpertGemmParams& wgrad = task.matrix == 2 ? params.wgrad_down : params.wgrad_gate_up;
    const int num_m_tiles = (wgrad.m_extent + BLOCK_M - 1) / BLOCK_M;
    queued.expert = task.expert;
    queued.matrix = task.matrix;
    queued.n_tile = task.m_tile / num_m_tiles;
    queued.m_tile = task.m_tile % num_m_tiles;
    const int32_t first_tile = plan.expert_tiles[task.expert];
    queued.k_row0 = first_tile * BLOCK_M;
    queued.num_k_blocks = (plan.expert_tiles[task.expert + 1] - first_tile) * (BLOCK_M / BLOCK_K);
    return queued;
  }
  queued.expert = expert_of_tile(plan, task.m_tile);
  switch (task.kind) {
    case BackwardTaskKind::kRecompute:
      queued.num_k_blocks = params.recompute.k_extent / BLOCK_K;
      break;
    case BackwardTaskKind::kDownDgrad:
      queued.num_k_blocks = params.down_dgrad.k_extent / BLOCK_K;
      break;
    case BackwardTaskKind::kGateUpDgrad:
      queued.num_k_blocks = 2 * params.gate_up_dgrad.k_extent / BLOCK_K;
      break;
    default:  // kSwiglu: its row blocks through the ring
      queued.num_k_blocks = swiglu_task_stages(params.swiglu.vectors_per_row * 8);
      break;
  }
  return queued;
}

__device__ __forceinline__ TileCoord coord_of(const QueuedTask& task) {
  TileCoord coord;
  coord.expert = task.expert;
  coord.m_tile = task.m_tile;
  coord.n_tile = task.n_tile;
  coord.k_row0 = task.k_row0;
  coord.num_k_blocks = task.num_k_blocks;
  return coord;
}

__device__ __forceinline__ void schedule_and_load(const BackwardGemmsMaps& maps,
                                                  const BackwardGemmsParams& params, Storage& smem,
                                                  TaskQueue<QueuedTask>& queue,
                                                  const int32_t* const expert_tiles[2]) {
  const BackwardSetParams& routed = params.sets[0];
  const WaitContext& wait = routed.down_dgrad.wait;
  BackwardPlans plans;
  plans.num_sets = params.num_sets;
  for (int set = 0; set < params.num_sets; ++set)
    plans.sets[set] = plan_of(params.sets[set], expert_tiles[set]);
  const int64_t num_tasks_here = num_tasks(plans);
  const unsigned long long epoch = launch_epoch(params);
  const unsigned long long ticket_base = epoch << 32;
  // Only the routed set gathers rows (the shared expert's are the tokens themselves).
  const unsigned long long d_out_epoch =
      routed.d_out_gather.x != nullptr ? gather_epoch(routed.d_out_gather) : 0;
  const unsigned long long x_epoch =
      routed.x_gather.x != nullptr ? gather_epoch(routed.x_gather) : 0;
  PipelineState<kNumStages> state;
  uint32_t published = 0;  // tasks in the queue so far
  SegmentCursor cursor;    // this CTA's tickets only grow
  // The expert (set * 2^16 + expert) whose SwiGLU tasks this thread last saw finished: its next
  // weight-gradient tiles (an expert has hundreds, several per CTA in a row) need no second
  // look at the counter.
  int32_t ready_expert = -1;
  // Decodes `ticket` (taking further tickets past the rows tasks, which the spare warps or the
  // expansion before the launch ran) into the task the consumers need; past the last task, the
  // stop task. Runs after the current task's loads are issued, while the consumers still have
  // its last stages to compute (the decode takes 1-2 us on this 56-register thread, traced).
  uint64_t ticket_ns = 0, decoded_ns = 0;  // of the task decoded last (the task trace)
  auto decode = [&](long long ticket) {
    ticket_ns = trace_clock(params.trace);
    QueuedTask queued{kStopTask, 0, 0, 0, 0, 0, 0, 0, -1};
    while (ticket < num_tasks_here) {
      const BackwardTask task = backward_task_at(plans, ticket, &cursor);
      if (task.kind != BackwardTaskKind::kRows) {
        queued = queued_task(params.sets[task.set], plans.sets[task.set], task);
        queued.ticket = static_cast<int32_t>(ticket);
        break;
      }
      ticket = static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
      ticket_ns = trace_clock(params.trace);
    }
    decoded_ns = trace_clock(params.trace);
    return queued;
  };
  atomicMax(params.ticket, ticket_base);
  QueuedTask next = decode(static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base));
  for (;;) {
    const QueuedTask queued = next;
    if (queued.kind != kStopTask) {
      // Its dependency, now that the previous task's loads are all issued (progress: a task
      // waits only for smaller tickets, whose loads were issued before theirs was queued).
      const uint64_t wait_ns = trace_clock(params.trace);
      const auto kind = static_cast<BackwardTaskKind>(queued.kind);
      const BackwardSetParams& set = params.sets[queued.set];
      const BackwardPlan& plan = plans.sets[queued.set];
      const int32_t expert_key = (queued.set << 16) + queued.expert;
      if (kind == BackwardTaskKind::kRecompute && set.x_gather.x != nullptr) {
        wait_for_gathered_tile(wait, set.x_gather, queued.m_tile, x_epoch);
      } else if (kind == BackwardTaskKind::kDownDgrad && set.d_out_gather.x != nullptr) {
        wait_for_gathered_tile(wait, set.d_out_gather, queued.m_tile, d_out_epoch);
      } else if (kind == BackwardTaskKind::kSwiglu) {
        wait_for_count(wait, WaitSite::kRowGemmsDone, set.row_gemms_done + queued.m_tile, epoch,
                       plan.down_dgrad_n_tiles + (plan.recompute != 0 ? plan.gate_up_n_tiles : 0));
        asm volatile("fence.proxy.async.global;" ::: "memory");
      } else if (kind == BackwardTaskKind::kGateUpDgrad) {
        wait_for_count(wait, WaitSite::kSwigluDone, set.swiglu_done + queued.m_tile, epoch, 1);
        asm volatile("fence.proxy.async.global;" ::: "memory");
      } else if (kind == BackwardTaskKind::kWeightGrad && expert_key != ready_expert) {
        const int32_t* tiles_of = expert_tiles[queued.set];
        const int32_t tiles = tiles_of[queued.expert + 1] - tiles_of[queued.expert];
        if (tiles > 0) {
          wait_for_count(wait, WaitSite::kExpertReady, set.expert_ready + queued.expert, epoch,
                         tiles);
          asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        ready_expert = expert_key;
      }
      // The trace's kinds: the routed set's BackwardTaskKind, then the shared set's.
      trace_queued(params.trace, queued.ticket, queued.kind + queued.set * kNumBackwardTaskKinds,
                   queued.m_tile, queued.n_tile, queued.expert, ticket_ns, decoded_ns, wait_ns);
    }
    queue.publish(wait, published++, queued);
    if (queued.kind == kStopTask) return;
    // The next ticket now: the atomic's round trip overlaps this task's first loads.
    const long long next_ticket =
        static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
    const TileCoord coord = coord_of(queued);
    const auto kind = static_cast<BackwardTaskKind>(queued.kind);
    const BackwardSetMaps& set_maps = maps.sets[queued.set];
    const BackwardSetParams& set = params.sets[queued.set];
    const int64_t intermediate = set.swiglu.vectors_per_row * 8;
    // The next ticket is decoded after the last K-block is issued, while the consumers work
    // through the ring's last stages. Decoding after the first K-block instead (to hide it behind
    // the previous task) held the decode's state live across the K-block loop: the producer
    // spilled in it and every GEMM tile ran 25-30% longer (docs/perf.md, session 7).
    for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block) {
      produce_stage(
          wait, smem, state,
          kind == BackwardTaskKind::kSwiglu ? swiglu_stage_bytes(intermediate, k_block)
                                            : kTileABytes + kTileBBytes,
          [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
            switch (kind) {
              case BackwardTaskKind::kSwiglu:
                issue_swiglu_loads(&set_maps.swiglu_gate, &set_maps.swiglu_up, &set_maps.swiglu_dh,
                                   intermediate, coord.m_tile, 0, k_block, a_dst, b_dst, full);
                break;
              case BackwardTaskKind::kRecompute:
                issue_loads<ExpertGemmForm::kGateUpStore>(
                    &set_maps.x_rows, &set_maps.x_rows, &set_maps.w_gate, &set_maps.w_up,
                    set.recompute, coord, k_block, a_dst, b_dst, full);
                break;
              case BackwardTaskKind::kDownDgrad:
                issue_loads<ExpertGemmForm::kDownGrad>(
                    &set_maps.d_out_rows, &set_maps.d_out_rows, &set_maps.w_down_mn,
                    &set_maps.w_down_mn, set.down_dgrad, coord, k_block, a_dst, b_dst, full);
                break;
              case BackwardTaskKind::kGateUpDgrad:
                issue_loads<ExpertGemmForm::kGateUpGradStore>(
                    &set_maps.d_gate, &set_maps.d_up, &set_maps.w_gate_mn, &set_maps.w_up_mn,
                    set.gate_up_dgrad, coord, k_block, a_dst, b_dst, full);
                break;
              default: {  // kWeightGrad
                const CUtensorMap* a = queued.matrix == 0   ? &set_maps.d_gate_mn
                                       : queued.matrix == 1 ? &set_maps.d_up_mn
                                                            : &set_maps.d_out_mn;
                const CUtensorMap* b = queued.matrix == 2 ? &set_maps.h_w_mn : &set_maps.x_mn;
                issue_loads<ExpertGemmForm::kWeightGrad>(a, a, b, b, set.wgrad_gate_up, coord,
                                                         k_block, a_dst, b_dst, full);
                break;
              }
            }
          });
    }
    next = decode(next_ticket);
  }
}

__global__ void __launch_bounds__(kNumThreads, 1)
    backward_gemms_kernel(const __grid_constant__ BackwardGemmsMaps maps,
                          const __grid_constant__ BackwardGemmsParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                              ~uintptr_t{1023});
  auto& queue =
      *reinterpret_cast<TaskQueue<QueuedTask>*>(reinterpret_cast<char*>(&smem) + sizeof(Storage));
  // Each set's expert row-tile starts (E_loc + 1 entries, then 2 for the shared expert).
  const BackwardSetParams& routed = params.sets[0];
  int32_t* routed_tiles = reinterpret_cast<int32_t*>(&queue + 1);
  int32_t* shared_tiles = routed_tiles + routed.down_dgrad.num_experts + 1;
  for (int set = 0; set < params.num_sets; ++set) {
    const ExpertGemmParams& gemm = params.sets[set].down_dgrad;
    int32_t* tiles = set == 0 ? routed_tiles : shared_tiles;
    for (int e = threadIdx.x; e <= gemm.num_experts; e += blockDim.x)
      tiles[e] = gemm.expert_offsets[e] / BLOCK_M;
  }
  if (threadIdx.x == 0) queue.init();
  init_pipeline(smem);  // also fences the barrier inits and syncs the CTA
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      const BackwardSetMaps& routed_maps = maps.sets[0];
      for (const CUtensorMap* map :
           {&routed_maps.x_rows, &routed_maps.d_out_rows, &routed_maps.w_down_mn,
            &routed_maps.d_gate, &routed_maps.d_up, &routed_maps.d_gate_mn, &routed_maps.x_mn})
        ptx::prefetch_tensor_map(map);
      const int32_t* const expert_tiles[2] = {routed_tiles, shared_tiles};
      schedule_and_load(maps, params, smem, queue, expert_tiles);
    } else if (threadIdx.x >= 32) {
      // The spare warps gather the routed rows (any CTA's warps take any row: progress with any
      // number of resident CTAs).
      const ScheduleHeader* header = routed.down_dgrad.header;
      if (routed.d_out_gather.x != nullptr)
        gather_rows_into_tiles(routed.d_out_gather, header, routed.down_dgrad.row_pair,
                               gather_epoch(routed.d_out_gather));
      if (routed.x_gather.x != nullptr)
        gather_rows_into_tiles(routed.x_gather, header, routed.down_dgrad.row_pair,
                               gather_epoch(routed.x_gather));
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    const bool issuer = threadIdx.x == BLOCK_M;
    const unsigned long long epoch = launch_epoch(params);
    const WaitContext& wait = routed.down_dgrad.wait;
    PipelineState<kNumStages> state;
    uint32_t queued_count = 0;  // tasks read so far
    // The accumulators stay live across tasks in ptxas's view (the wgmma operands read them),
    // so the SwiGLU task's registers come on top of them: ptxas spills ~200 bytes here
    // (docs/perf.md). Zeroing them after the SwiGLU task would end their life there, but made
    // ptxas serialize every wgmma (C7515).
    float acc[128];
    for (;;) {
      const QueuedTask task = queue.read(wait, queued_count++);
      if (task.kind == kStopTask) break;
      if (issuer) trace_started(params.trace, task.ticket);
      const auto kind = static_cast<BackwardTaskKind>(task.kind);
      const BackwardSetParams& set = params.sets[task.set];
      const BackwardSetMaps& set_maps = maps.sets[task.set];
      if (kind == BackwardTaskKind::kSwiglu) {
        run_swiglu_tile(wait, smem, state, set.swiglu, task.m_tile,
                        set.down_dgrad.header->total_rows);
        // Device scope (system scope for router-weight gradients that went to other GPUs,
        // read after the push's signal), and toward the async proxy: the tiles that wait for
        // this task load d_g, d_u and h_w with TMA.
        if (set.swiglu.d_router_weights_peers != nullptr)
          __threadfence_system();
        else
          __threadfence();
        asm volatile("fence.proxy.async.global;" ::: "memory");
        ptx::named_barrier_sync(kSwigluBarrier, kConsumerThreads);
        if (issuer) {
          count_done(set.swiglu_done + task.m_tile, epoch);
          count_done(set.expert_ready + task.expert, epoch);
        }
      } else if (kind == BackwardTaskKind::kRecompute) {
        consume_tile<false, false>(wait, smem, state, task.num_k_blocks, consumer_idx, acc);
        store_tile<ExpertGemmForm::kGateUpStore>({&set_maps.gate_out, &set_maps.up_out, nullptr},
                                                 smem, set.recompute, coord_of(task), consumer_idx,
                                                 acc);
        if (issuer) count_stored_tile(set.row_gemms_done + task.m_tile, epoch);
      } else if (kind == BackwardTaskKind::kDownDgrad) {
        consume_tile<false, true>(wait, smem, state, task.num_k_blocks, consumer_idx, acc);
        store_tile<ExpertGemmForm::kDownGrad>({&set_maps.dh_out, nullptr, nullptr}, smem,
                                              set.down_dgrad, coord_of(task), consumer_idx, acc);
        if (issuer) count_stored_tile(set.row_gemms_done + task.m_tile, epoch);
      } else if (kind == BackwardTaskKind::kGateUpDgrad) {
        consume_tile<false, true>(wait, smem, state, task.num_k_blocks, consumer_idx, acc);
        store_tile<ExpertGemmForm::kGateUpGradStore>({&set_maps.dx_out, nullptr, nullptr}, smem,
                                                     set.gate_up_dgrad, coord_of(task),
                                                     consumer_idx, acc);
      } else {  // kWeightGrad
        consume_tile<true, true>(wait, smem, state, task.num_k_blocks, consumer_idx, acc);
        const CUtensorMap* out = task.matrix == 0   ? &set_maps.d_w_gate
                                 : task.matrix == 1 ? &set_maps.d_w_up
                                                    : &set_maps.d_w_down;
        store_tile<ExpertGemmForm::kWeightGrad>(
            {out, nullptr, nullptr}, smem, task.matrix == 2 ? set.wgrad_down : set.wgrad_gate_up,
            coord_of(task), consumer_idx, acc);
      }
      if (issuer) trace_finished(params.trace, task.ticket);
    }
    // Outstanding TMA stores read the staging tile: it must outlive them.
    if (issuer) ptx::bulk_wait_group<0>();
  }
}

}  // namespace

cudaError_t launch_backward_gemms(const BackwardGemmsMaps& maps, const BackwardGemmsParams& params,
                                  int num_ctas, cudaStream_t stream) {
  if (num_ctas < 1 || params.num_sets < 1 || params.num_sets > 2) return cudaErrorInvalidValue;
  for (int set = 0; set < params.num_sets; ++set)
    if (params.sets[set].down_dgrad.num_experts < 0 || params.sets[set].minibatch_tiles < 1)
      return cudaErrorInvalidValue;
  // The sets' expert row-tile starts follow the queue: E_loc + 1, and 2 for the shared expert.
  const size_t smem_bytes = sizeof(Storage) + sizeof(TaskQueue<QueuedTask>) +
                            (static_cast<size_t>(params.sets[0].down_dgrad.num_experts) + 3) * 4 +
                            1024;
  cudaError_t status =
      cudaFuncSetAttribute(backward_gemms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  backward_gemms_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps, params);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("backward_gemms.cu", {kernel_symbol(&backward_gemms_kernel)});
}  // namespace

}  // namespace mok::kernels
