// The `mok` command-line tool: `mok run` is the project's main job (DESIGN.md section 3).
// On a GPU it runs mok's layer against the unfused baseline (tools/run_gpu.cpp); without one it
// runs the CPU reference against the fp64 oracle (tools/run_cpu.cpp).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "cli.h"
#include "mok/config.h"
#include "mok/testing/comm_bench.h"
#include "mok/testing/stream_bench.h"
#include "mok/testing/walk_bench.h"

namespace mok::cli {

namespace {

using mok::Error;
using mok::ErrorCode;

const char* kUsage = R"(mok: deterministic MoE training layer for Hopper GPUs

usage:
  mok run [options]     run the layer on a shape and check it (the main job)
  mok stream-bench [--shape NAME]
                        GPU: how fast the shape's expert weights stream in the GEMMs' access
                        pattern and others (TMA loads only; default dsv3)
  mok walk-bench [--shape NAME] [--routing KIND] [--seed S] [--once] [--pace-sweep]
                 [--fabric-probe]
                        GPU: the row-tile GEMMs' operand loads replayed without their math,
                        walk by walk (tile shapes, groupings) over the shape's row tiles, paced
                        as their wgmmas hold a stage (default dsv3_e128); --once runs each
                        walk once, for ncu's sector counts; --pace-sweep replays only the
                        expert GEMM's walk at a range of holds per K-block, on 3 and 4 stages,
                        with one operand's loads, fewer stages held, fewer CTAs (cycles per
                        K-block and where they go, SM clock);
                        --fabric-probe: each L2 partition's SMs reading an 8 MB buffer (for
                        ncu's fabric sectors: are far lines kept in the near partition?)
  mok shapes            list the named shapes
  mok --help | --version

mok run options:
  --shape NAME                 tiny, qwen3, dsv3, dsv3_local, kimi_slice (default: dsv3_local
                               on a GPU, the single-GPU target; tiny on the CPU)
  --tokens N                   tokens per rank (default: the shape's)
  --experts E                  routed experts in the whole group (default: the shape's)
  --ranks R                    expert-parallel ranks, emulated in one process (default 1)
  --top-k K                    routing slots per token (default: the shape's)
  --shared-intermediate IS     add a shared expert of intermediate size IS (default none)
  --clamp L                    SwiGLU clamp limit (default none)
  --routing KIND               uniform (default), holes, skewed, one_expert, one_rank,
                               empty_rank, no_routes
  --seed S                     random seed of inputs and routing (default 1)
  --threads N                  CPU threads of the reference (default: all)
  --check-tokens N             tokens the fp64 oracle checks (default: all that fit a budget)
  --precision P                bf16 (default) or fp8_block (e4m3 with 1x128 / 128x128 block
                               scales): on a GPU timed beside bf16 and checked against the
                               reference's FP8; with --gpus the group in FP8; on the CPU the
                               reference, compared with its bf16 run
  --local-dispatch MODE        GPU: gather-kernel or producer-warps (default: the library's;
                               both give the same bits, the run times both)
  --gpus N                     the expert-parallel layer on GPUs 0..N-1 of this machine, one
                               process (default shape kimi_slice: E = 8 per GPU); N ranks
  --persistent-forward         GPU: run the forward GEMMs as one persistent kernel (the run
                               times both ways either way)
  --persistent-backward        GPU: run the routed experts' backward as one persistent kernel
                               (the run checks and times both ways either way)
  --cta-pairs                  GPU: run the expert GEMMs in clusters of two CTAs that multicast
                               the weight tile they share (the run times both ways either way)
  --wide-tiles                 GPU: run the forward GEMMs and both dgrads in 256 x 192 tiles
  --l2-placement               GPU: the expert GEMMs' row tiles split between the L2's two
                               partitions (probed when the layer is built; same bits)
  --four-stages                GPU: the row-tile GEMMs (forward and dgrads) on a ring of four
                               stages, their outputs stored in two rounds of 128 columns
  --swiglu-in-dgrad            GPU: the backward's down dgrad runs the SwiGLU backward in its
                               epilogue instead of a pass of its own (swiglu_backward_in_dgrad;
                               the kernel sequence, bf16; same bits)
  --overlap-launches           GPU: the layer's kernels launched with programmatic dependent
                               launch, each scheduled while the previous one finishes
                               (overlap_kernel_launches; same bits)
  --aligned-groups             GPU: each group of the row-tile GEMMs' walk starts where an
                               expert does (within 4 row tiles), so no expert straddles two
                               groups (gemm_expert_aligned_groups; same bits)
  --dgrad-half-tiles           GPU: 64-row last tiles in the backward's dgrads too, where the
                               forward runs them (gemm_dgrad_half_row_tiles; same bits)
  --no-auto-lockstep           GPU: where the weights stream from HBM and the experts average
                               under 192 rows (dsv3), do not run four stages in step within 16
                               K-blocks by default (gemm_auto_lockstep off; same bits)
  --tiles-by-ticket            GPU: the row-tile expert GEMMs take their tiles from a ticket
                               counter instead of the static walk (same bits)
  --padding-rows               GPU: compute the padding rows of each expert's last row tile
                               instead of running it as a 64-row tile (skip_padding_rows off)
  --compare K1,K2,...          with --quick: each knob flipped on a layer of its own, checked
                               bitwise against the layer and timed beside it in the same rounds
                               (cta-pairs, persistent-forward, persistent-backward,
                               weight-grad-pingpong, skip-padding-rows, local-dispatch,
                               wide-tiles, tile-group-N: the GEMM walk in groups of N,
                               l2-placement, four-stages, lockstep-N: the CTAs in step
                               within N K-blocks, 0 off, tiles-by-ticket, auto-lockstep,
                               aligned-groups, dgrad-half-tiles, expert-groups-N: FP8's
                               walk in groups of one expert's tiles, swiglu-in-dgrad,
                               overlap-launches, fp8-rows-192: FP8's row-tile GEMMs in
                               192-row tiles, or 128 where the shape chose 192,
                               fp8-wgrad-staging-2: FP8's weight gradients with two
                               staging tiles, fp8-swiglu-in-gate-up: FP8's SwiGLU in the
                               gate/up GEMM's epilogue in every forward, fp8-swiglu-pass:
                               FP8's SwiGLU as a pass of its own in every forward,
                               fp8-gather-in-gate-up: FP8's x rows gathered and quantized by
                               the gate/up GEMM in a forward without a context); K1+K2
                               flips several on one layer. An FP8 run (--precision
                               fp8_block) takes it without --quick: the flipped FP8 layers
                               timed beside it
  --quick                      GPU: time only the layer against the baseline, check it against
                               the reference, skip the ring, the variants and the stage
                               breakdowns (for A/B runs of two builds; a third of the time)
  --tile-group N               GPU: row tiles the expert GEMMs' walk takes together before the
                               next group (1-1024, default 8; same bits)
  --expert-groups N            GPU, FP8: the row-tile GEMMs walk each expert's row tiles as
                               groups of their own, at most N a group (gemm_expert_groups;
                               default 0: groups of 8; same bits)
  --fp8-rows N                 GPU, FP8: the row-tile GEMMs' tile height, 128 or 192
                               (fp8_row_tile_rows; default 0: chosen by shape; same bits);
                               the stage tables are printed for this height
  --lockstep N                 GPU: no CTA of a row-tile expert GEMM runs more than about N
                               K-blocks ahead of the slowest (2-4096; default 0: off; same bits)
  --minibatch-size N           GPU: rows per overlap step of the persistent kernels (multiple of
                               128; default 0: two SM waves of tiles per GEMM of a minibatch)
  --macrobatch-size N          GPU: rows of the ring buffers of routed intermediates (multiple of
                               128 and of an explicit minibatch size; default 0: one macrobatch
                               while the ring fits 8 GiB; fewer rows, less memory, and the
                               backward recomputes all macrobatches but the first)
  --push-dispatch              --gpus: dispatch by push instead of pull (same bits; the run
                               times the other way's forward too)
  --dispatch-in-gemm           --gpus: the forward's dispatch and combine inside its GEMMs (the
                               gate/up GEMM pulls the routed rows from the peers, the down
                               GEMM pushes its rows to them; same bits; the run times the other
                               way too)
  --bulk-copies                --gpus: move dispatch/combine rows with the bulk-copy engine
  --json FILE                  also write the results as JSON
  --trace-tasks FILE           GPU: after the timing, run each persistent kernel of the run once
                               more with MoeConfig::trace_tasks, print where its SMs' time went
                               and write the tasks as a Chrome / Perfetto trace (JSON) to FILE
  --cpu                        run the CPU reference even where a GPU is present

On a GPU (one rank), `mok run` runs mok's forward and the unfused cuBLAS baseline in the same
run, checks both against the CPU reference on a slice of tokens, and prints times and TFLOP/s.
Without a GPU (or with --cpu, or --ranks > 1 for now), it runs the CPU reference forward and
backward, checks it against an independent fp64 implementation, and, where a GPU is present,
checks the GPU schedule builder against the host's.
)";

int64_t parse_int(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    long long value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw Error(ErrorCode::kInvalidArgument, flag + " expects an integer; got '" + text + "'");
}

RunOptions parse_run_options(const std::vector<std::string>& args) {
  RunOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--cpu") {
      options.cpu_only = true;
      continue;
    }
    if (flag == "--persistent-forward") {
      options.persistent_forward = true;
      continue;
    }
    if (flag == "--cta-pairs") {
      options.cta_pairs = true;
      continue;
    }
    if (flag == "--wide-tiles") {
      options.wide_tiles = true;
      continue;
    }
    if (flag == "--l2-placement") {
      options.l2_placement = true;
      continue;
    }
    if (flag == "--four-stages") {
      options.four_stages = true;
      continue;
    }
    if (flag == "--swiglu-in-dgrad") {
      options.swiglu_in_dgrad = true;
      continue;
    }
    if (flag == "--overlap-launches") {
      options.overlap_launches = true;
      continue;
    }
    if (flag == "--aligned-groups") {
      options.aligned_groups = true;
      continue;
    }
    if (flag == "--dgrad-half-tiles") {
      options.dgrad_half_tiles = true;
      continue;
    }
    if (flag == "--no-auto-lockstep") {
      options.no_auto_lockstep = true;
      continue;
    }
    if (flag == "--tiles-by-ticket") {
      options.tiles_by_ticket = true;
      continue;
    }
    if (flag == "--padding-rows") {
      options.padding_rows = true;
      continue;
    }
    if (flag == "--quick") {
      options.quick = true;
      continue;
    }
    if (flag == "--once") {
      options.once = true;
      continue;
    }
    if (flag == "--pace-sweep") {
      options.pace_sweep = true;
      continue;
    }
    if (flag == "--fabric-probe") {
      options.fabric_probe = true;
      continue;
    }
    if (flag == "--persistent-backward") {
      options.persistent_backward = true;
      continue;
    }
    if (flag == "--dispatch-in-gemm") {
      options.dispatch_in_gemm = true;
      continue;
    }
    if (flag == "--push-dispatch") {
      options.push_dispatch = true;
      continue;
    }
    if (flag == "--bulk-copies") {
      options.bulk_copies = true;
      continue;
    }
    static const char* const kValueOptions[] = {
        "--shape",           "--tokens",       "--experts",
        "--ranks",           "--top-k",        "--shared-intermediate",
        "--clamp",           "--routing",      "--seed",
        "--threads",         "--check-tokens", "--json",
        "--local-dispatch",  "--gpus",         "--minibatch-size",
        "--macrobatch-size", "--trace-tasks",  "--precision",
        "--compare",         "--tile-group",   "--lockstep",
        "--expert-groups",   "--fp8-rows"};
    if (std::find(std::begin(kValueOptions), std::end(kValueOptions), flag) ==
        std::end(kValueOptions))
      throw Error(ErrorCode::kInvalidArgument, "unknown option '" + flag + "' (see mok --help)");
    if (i + 1 >= args.size())
      throw Error(ErrorCode::kInvalidArgument,
                  "option " + flag + " needs a value (see mok --help)");
    const std::string& value = args[++i];
    if (flag == "--shape")
      options.shape_name = value;
    else if (flag == "--trace-tasks")
      options.trace_path = value;
    else if (flag == "--tokens")
      options.tokens = parse_int(flag, value);
    else if (flag == "--experts")
      options.experts = parse_int(flag, value);
    else if (flag == "--ranks")
      options.ranks = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--top-k")
      options.top_k = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--shared-intermediate")
      options.shared_intermediate = parse_int(flag, value);
    else if (flag == "--clamp")
      options.clamp = std::stof(value);
    else if (flag == "--routing")
      options.routing = value;
    else if (flag == "--seed")
      options.seed = static_cast<uint64_t>(parse_int(flag, value));
    else if (flag == "--threads")
      options.threads = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--check-tokens")
      options.check_tokens = parse_int(flag, value);
    else if (flag == "--json")
      options.json_path = value;
    else if (flag == "--precision")
      options.precision = value;
    else if (flag == "--local-dispatch")
      options.local_dispatch = mok::local_dispatch_name(mok::local_dispatch_from_name(value));
    else if (flag == "--gpus")
      options.gpus = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--minibatch-size")
      options.minibatch_size = parse_int(flag, value);
    else if (flag == "--macrobatch-size")
      options.macrobatch_size = parse_int(flag, value);
    else if (flag == "--tile-group")
      options.tile_group = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--expert-groups")
      options.expert_groups = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--fp8-rows")
      options.fp8_rows = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--lockstep")
      options.lockstep = static_cast<int32_t>(parse_int(flag, value));
    else if (flag == "--compare") {
      for (size_t begin = 0; begin <= value.size();) {
        const size_t end = std::min(value.find(',', begin), value.size());
        options.compare.push_back(value.substr(begin, end - begin));
        begin = end + 1;
      }
    } else
      throw Error(ErrorCode::kInvalidArgument, "unknown option '" + flag + "' (see mok --help)");
  }
  return options;
}

mok::MoeShape shape_from_options(const RunOptions& options) {
  if (options.ranks < 1)
    throw Error(ErrorCode::kInvalidArgument, "--ranks = " + std::to_string(options.ranks) +
                                                 "; valid: 1.." + std::to_string(mok::kMaxRanks));
  mok::MoeShape shape = mok::named_shape(options.shape_name, options.ranks);
  if (options.tokens >= 0) shape.num_tokens = options.tokens;
  if (options.experts >= 0) shape.num_experts = options.experts;
  if (options.top_k >= 0) shape.top_k = options.top_k;
  shape.shared_intermediate = options.shared_intermediate;
  if (options.clamp != 0) shape.swiglu_limit = options.clamp;
  mok::can_implement(shape).throw_if_error();
  return shape;
}

// --quick on a run it does not apply to.
[[noreturn]] void refuse_quick(const std::string& this_run) {
  throw Error(ErrorCode::kInvalidArgument, "--quick times the single-GPU bf16 layer; this run is " +
                                               this_run +
                                               "; valid: a single-GPU bf16 run on a GPU");
}

int run_command(RunOptions options) {
  if (options.gpus < 0)
    throw Error(ErrorCode::kInvalidArgument,
                "--gpus " + std::to_string(options.gpus) + "; valid: at least 1");
  if (options.gpus > 0) {
    if (options.ranks != 1 && options.ranks != options.gpus)
      throw Error(ErrorCode::kInvalidArgument, "--ranks " + std::to_string(options.ranks) +
                                                   " with --gpus " + std::to_string(options.gpus) +
                                                   "; valid: one rank per GPU (omit --ranks)");
    if (options.quick) refuse_quick("the expert-parallel layer (--gpus)");
    options.ranks = options.gpus;
    if (options.shape_name.empty()) options.shape_name = "kimi_slice";
    return run_ep(options, shape_from_options(options));
  }
  const std::string device_name = options.cpu_only ? "" : cuda_device_name();
  if (options.shape_name.empty())
    options.shape_name = device_name.empty() || options.ranks > 1 ? "tiny" : "dsv3_local";
  const mok::MoeShape shape = shape_from_options(options);
  const bool fp8 = mok::precision_from_name(options.precision) == mok::Precision::kFP8Block;
  // The CPU reference runs FP8 on any shape; the other knobs are checked as the GPU's, FP8's
  // where the FP8 GPU layer runs (elsewhere its knobs, which the reference has no use for, are
  // dropped from the check).
  const bool fp8_on_gpu = fp8 && !device_name.empty() && shape.num_ranks == 1;
  const RunOptions checked = fp8 && !fp8_on_gpu ? bf16_options_of(options) : options;
  const mok::MoeConfig checked_config = config_from_options(checked, shape);  // CPU path too
  for (const std::string& knob : options.compare) {
    if (!options.quick && !fp8_on_gpu)
      throw Error(ErrorCode::kInvalidArgument,
                  "--compare " + knob +
                      " without --quick; valid: --quick --compare (a full run times every knob "
                      "already), or a single-GPU FP8 run (--precision fp8_block)");
    // Names the knob if it is unknown, and what a flipped layer could not run.
    mok::can_implement(flip_knob(checked_config, knob), shape).throw_if_error();
  }
  if (options.quick && (device_name.empty() || shape.num_ranks != 1 || fp8))
    refuse_quick(fp8                   ? "an FP8 run"
                 : options.cpu_only    ? "the CPU reference (--cpu)"
                 : device_name.empty() ? "the CPU reference (no GPU)"
                                       : "the CPU reference (--ranks > 1)");
  if (!device_name.empty() && shape.num_ranks == 1)
    return fp8 ? run_gpu_fp8(options, shape, device_name) : run_gpu(options, shape, device_name);
  if (!options.trace_path.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "--trace-tasks " + options.trace_path +
                    " traces the persistent GPU kernels; this run is the CPU reference (" +
                    (device_name.empty() ? std::string("no GPU") : "--cpu or --ranks > 1") +
                    "); valid: a single-GPU run on a GPU");
  return run_cpu(options, shape);
}

// `mok comm-bench`: the data movement of the expert-parallel layer on --gpus N GPUs (default
// shape kimi_slice).
int comm_bench_command(RunOptions options) {
  if (options.gpus < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "comm-bench needs --gpus N (N >= 1): the GPUs of this machine to use");
  options.ranks = options.gpus;
  if (options.shape_name.empty()) options.shape_name = "kimi_slice";
  return mok::run_comm_bench(shape_from_options(options),
                             mok::routing_kind_from_name(options.routing), options.seed);
}

// The GPU benchmarks' refusal on a machine without a usable GPU.
void require_gpu(const std::string& command) {
  if (cuda_device_name().empty())
    throw Error(ErrorCode::kUnsupported, command +
                                             " times the GPU's memory system; no usable GPU here "
                                             "(valid: a run on an sm_90 GPU)");
}

// `mok stream-bench`: the memory roofline of a shape's weights (default dsv3: 256 experts on
// one GPU).
int stream_bench_command(RunOptions options) {
  require_gpu("stream-bench");
  if (options.shape_name.empty()) options.shape_name = "dsv3";
  return mok::run_stream_bench(shape_from_options(options));
}

// `mok walk-bench`: the row-tile GEMMs' loads replayed walk by walk (default dsv3_e128: one
// 256-row unit per expert, where the 256 x 192 tiles measured slower).
int walk_bench_command(RunOptions options) {
  require_gpu("walk-bench");
  if (options.shape_name.empty()) options.shape_name = "dsv3_e128";
  return mok::run_walk_bench(shape_from_options(options),
                             mok::routing_kind_from_name(options.routing), options.seed,
                             {options.once, options.pace_sweep, options.fabric_probe});
}

void list_shapes() {
  std::printf("%-12s %6s %6s %5s %3s %8s\n", "name", "H", "I", "E", "K", "tokens");
  for (const std::string& name : mok::named_shape_names()) {
    mok::MoeShape shape = mok::named_shape(name, 1);
    std::printf("%-12s %6lld %6lld %5lld %3d %8lld%s\n", name.c_str(),
                static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
                static_cast<long long>(shape.num_experts), shape.top_k,
                static_cast<long long>(shape.num_tokens),
                name == "kimi_slice" ? "  (E = 8 per rank)" : "");
  }
}

}  // namespace

}  // namespace mok::cli

int main(int argc, char** argv) {
  // Line-buffered even into a pipe or a log: a run killed by a timeout keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << mok::cli::kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version") {
      std::printf("mok 0.1.0\n");
      return 0;
    }
    if (args[0] == "shapes") {
      mok::cli::list_shapes();
      return 0;
    }
    if (args[0] == "run")
      return mok::cli::run_command(mok::cli::parse_run_options({args.begin() + 1, args.end()}));
    if (args[0] == "comm-bench")
      return mok::cli::comm_bench_command(
          mok::cli::parse_run_options({args.begin() + 1, args.end()}));
    if (args[0] == "stream-bench")
      return mok::cli::stream_bench_command(
          mok::cli::parse_run_options({args.begin() + 1, args.end()}));
    if (args[0] == "walk-bench")
      return mok::cli::walk_bench_command(
          mok::cli::parse_run_options({args.begin() + 1, args.end()}));
    throw mok::Error(
        mok::ErrorCode::kInvalidArgument,
        "unknown command '" + args[0] +
            "'; valid: run, comm-bench, stream-bench, walk-bench, shapes (see mok --help)");
  } catch (const mok::Error& error) {
    std::fprintf(stderr, "mok: error (%s): %s\n", mok::error_code_name(error.code()), error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mok: error: %s\n", error.what());
    return 2;
  }
}
