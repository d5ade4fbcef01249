// mok._C: the Python binding of mok's C++ API (nanobind), the front end under mok.ops. It includes
// only mok's public headers and no PyTorch header: tensors arrive through DLPack (tensors.h), so
// one build serves every PyTorch version. What it binds:
//   MoeShape, MoeConfig, named_shape     the layer's shape and tuning knobs
//   reference_forward / _backward        the CPU reference on CPU tensors (GIL released)
//   quantize_weight_fp8                  bf16 weights to pre-quantized FP8 (codes, scales)
//   GpuLayer                             the single-GPU layer: its workspace is allocated when it
//                                        is built (before any CUDA-graph capture); forward and
//                                        backward launch on the stream given as an integer (the
//                                        caller's current stream) without host synchronization
//   SmClockWindow                        the SM clock over a stretch of a stream's work,
//                                        measured on the device (the benchmark's GHz)
//   make_unique_id, Communicator,        expert parallelism, one process per GPU (built with
//   EpLayer                              NCCL)
// mok::Error becomes ValueError (invalid argument), NotImplementedError (unsupported) or
// RuntimeError (device faults, timeouts with their diagnosis, CUDA and NCCL errors), with mok's
// message.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mok/config.h"
#include "mok/error.h"
#include "mok/fp8_weights.h"
#include "mok/gpu_layer.h"
#include "mok/layer_args.h"
#include "mok/reference.h"
#include "mok/shape.h"
#include "mok/sm_clock.h"
#include "tensors.h"
#if MOK_HAS_NCCL
#include "mok/bootstrap.h"
#include "mok/comm.h"
#include "mok/ep_layer.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace mok::python {

namespace {

using OptionalArray = std::optional<Array>;

cudaStream_t stream_of(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

using ScaleArrays = std::vector<OptionalArray>;

// A call's tensors. A weight whose dtype is float8_e4m3fn holds the codes of a pre-quantized
// weight (ForwardArgs::w_*_fp8): its block scales are `weight_scales` at the weight's index
// (gate, up, down, shared gate, shared up, shared down). An empty `weight_scales` gives none.
ForwardArgs forward_args(const Array& x, const Array& top_experts, const Array& router_weights,
                         const Array& w_gate, const Array& w_up, const Array& w_down,
                         const OptionalArray& w_shared_gate, const OptionalArray& w_shared_up,
                         const OptionalArray& w_shared_down, const ScaleArrays& weight_scales) {
  ForwardArgs args;
  args.x = view_of(x, "x");
  args.top_experts = view_of(top_experts, "top_experts");
  args.router_weights = view_of(router_weights, "router_weights");
  if (!weight_scales.empty() && weight_scales.size() != 6)
    throw Error(ErrorCode::kInvalidArgument,
                "argument `weight_scales` has " + std::to_string(weight_scales.size()) +
                    " entries; expected 6 (gate, up, down, shared gate, shared up, shared down; "
                    "None for a bf16 weight) or none");
  struct Weight {
    const char* name;
    TensorView* values;
    Fp8BlockWeight* fp8;
  };
  const Weight weights[6] = {{"w_gate", &args.w_gate, &args.w_gate_fp8},
                             {"w_up", &args.w_up, &args.w_up_fp8},
                             {"w_down", &args.w_down, &args.w_down_fp8},
                             {"w_shared_gate", &args.w_shared_gate, &args.w_shared_gate_fp8},
                             {"w_shared_up", &args.w_shared_up, &args.w_shared_up_fp8},
                             {"w_shared_down", &args.w_shared_down, &args.w_shared_down_fp8}};
  const TensorView given[6] = {
      view_of(w_gate, "w_gate"),           view_of(w_up, "w_up"),
      view_of(w_down, "w_down"),           view_of(w_shared_gate, "w_shared_gate"),
      view_of(w_shared_up, "w_shared_up"), view_of(w_shared_down, "w_shared_down")};
  for (int i = 0; i < 6; ++i) {
    const OptionalArray& scales =
        weight_scales.empty() ? OptionalArray{} : weight_scales[static_cast<size_t>(i)];
    const bool codes = given[i].present() && given[i].dtype == DType::kFloat8E4M3;
    if (!codes) {
      if (scales.has_value())
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("argument `weight_scales[") + std::to_string(i) +
                        "]` was given but `" + weights[i].name +
                        "` is not float8_e4m3fn codes; pass None for a bf16 weight");
      *weights[i].values = given[i];
      continue;
    }
    weights[i].fp8->codes = given[i];
    weights[i].fp8->scales = view_of(scales, "weight_scales");
  }
  return args;
}

// The outputs of a backward call, in mok's order; the weight gradients None when frozen
// (BackwardArgs: all of them absent).
struct GradientArrays {
  Array d_x, d_router_weights;
  OptionalArray d_w_gate, d_w_up, d_w_down, d_w_shared_gate, d_w_shared_up, d_w_shared_down;
};

BackwardArgs backward_args(ForwardArgs forward, const Array& d_out, const GradientArrays& grads,
                           bool accumulate_weight_grads) {
  BackwardArgs args;
  args.accumulate_weight_grads = accumulate_weight_grads;
  args.forward = forward;
  args.d_out = view_of(d_out, "d_out");
  args.d_x = view_of(grads.d_x, "d_x");
  args.d_router_weights = view_of(grads.d_router_weights, "d_router_weights");
  args.d_w_gate = view_of(grads.d_w_gate, "d_w_gate");
  args.d_w_up = view_of(grads.d_w_up, "d_w_up");
  args.d_w_down = view_of(grads.d_w_down, "d_w_down");
  args.d_w_shared_gate = view_of(grads.d_w_shared_gate, "d_w_shared_gate");
  args.d_w_shared_up = view_of(grads.d_w_shared_up, "d_w_shared_up");
  args.d_w_shared_down = view_of(grads.d_w_shared_down, "d_w_shared_down");
  return args;
}

void translate_errors(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    switch (e.code()) {
      case ErrorCode::kInvalidArgument:
        PyErr_SetString(PyExc_ValueError, e.what());
        break;
      case ErrorCode::kUnsupported:
        PyErr_SetString(PyExc_NotImplementedError, e.what());
        break;
      default:
        PyErr_SetString(
            PyExc_RuntimeError,
            (std::string("mok ") + error_code_name(e.code()) + ": " + e.what()).c_str());
        break;
    }
  }
}

void bind_shape_and_config(nb::module_& m) {
  nb::class_<MoeShape>(m, "MoeShape")
      .def(nb::init<>())
      .def_rw("num_tokens", &MoeShape::num_tokens)
      .def_rw("hidden", &MoeShape::hidden)
      .def_rw("intermediate", &MoeShape::intermediate)
      .def_rw("num_experts", &MoeShape::num_experts)
      .def_rw("top_k", &MoeShape::top_k)
      .def_rw("num_ranks", &MoeShape::num_ranks)
      .def_rw("shared_intermediate", &MoeShape::shared_intermediate)
      .def_rw("swiglu_limit", &MoeShape::swiglu_limit)
      .def("num_local_experts", &MoeShape::num_local_experts)
      .def("check", [](const MoeShape& shape) { can_implement(shape).throw_if_error(); })
      .def("__repr__", &MoeShape::to_string);
  m.def(
      "named_shape",
      [](const std::string& name, int32_t num_ranks) { return named_shape(name, num_ranks); },
      "name"_a, "num_ranks"_a = 1);
  m.def("named_shape_names", &named_shape_names);

  nb::class_<MoeConfig>(m, "MoeConfig")
      .def(nb::init<>())
      .def_rw("fwd_num_comm_sms", &MoeConfig::fwd_num_comm_sms)
      .def_rw("bwd_num_comm_sms", &MoeConfig::bwd_num_comm_sms)
      .def_rw("minibatch_size", &MoeConfig::minibatch_size)
      .def_rw("macrobatch_size", &MoeConfig::macrobatch_size)
      .def_rw("wait_timeout_s", &MoeConfig::wait_timeout_s)
      .def_rw("persistent_forward", &MoeConfig::persistent_forward)
      .def_rw("persistent_backward", &MoeConfig::persistent_backward)
      .def_rw("gemm_cta_pairs", &MoeConfig::gemm_cta_pairs)
      .def_rw("gemm_wide_tiles", &MoeConfig::gemm_wide_tiles)
      .def_rw("gemm_tile_group", &MoeConfig::gemm_tile_group)
      .def_rw("gemm_expert_aligned_groups", &MoeConfig::gemm_expert_aligned_groups)
      .def_rw("gemm_expert_groups", &MoeConfig::gemm_expert_groups)
      .def_rw("fp8_row_tile_rows", &MoeConfig::fp8_row_tile_rows)
      .def_rw("fp8_weight_grad_staging_tiles", &MoeConfig::fp8_weight_grad_staging_tiles)
      .def_prop_rw(
          "fp8_swiglu",
          [](const MoeConfig& config) {
            return std::string(fp8_swiglu_place_name(config.fp8_swiglu));
          },
          [](MoeConfig& config, const std::string& name) {
            config.fp8_swiglu = fp8_swiglu_place_from_name(name);
          })
      .def_rw("fp8_gather_in_gate_up", &MoeConfig::fp8_gather_in_gate_up)
      .def_rw("gemm_l2_placement", &MoeConfig::gemm_l2_placement)
      .def_rw("gemm_four_stages", &MoeConfig::gemm_four_stages)
      .def_rw("gemm_lockstep_k_blocks", &MoeConfig::gemm_lockstep_k_blocks)
      .def_rw("gemm_auto_lockstep", &MoeConfig::gemm_auto_lockstep)
      .def_rw("gemm_tiles_by_ticket", &MoeConfig::gemm_tiles_by_ticket)
      .def_rw("skip_padding_rows", &MoeConfig::skip_padding_rows)
      .def_rw("gemm_dgrad_half_row_tiles", &MoeConfig::gemm_dgrad_half_row_tiles)
      .def_rw("swiglu_backward_in_dgrad", &MoeConfig::swiglu_backward_in_dgrad)
      .def_rw("overlap_kernel_launches", &MoeConfig::overlap_kernel_launches)
      .def_rw("weight_grad_pingpong", &MoeConfig::weight_grad_pingpong)
      .def_rw("check_finite", &MoeConfig::check_finite)
      .def_rw("ep_bulk_copies", &MoeConfig::ep_bulk_copies)
      .def_rw("ep_push_dispatch", &MoeConfig::ep_push_dispatch)
      .def_rw("ep_dispatch_in_gemm", &MoeConfig::ep_dispatch_in_gemm)
      .def_prop_rw(
          "local_dispatch",
          [](const MoeConfig& config) {
            return std::string(local_dispatch_name(config.local_dispatch));
          },
          [](MoeConfig& config, const std::string& name) {
            config.local_dispatch = local_dispatch_from_name(name);
          })
      .def_prop_rw(
          "precision",
          [](const MoeConfig& config) { return std::string(precision_name(config.precision)); },
          [](MoeConfig& config, const std::string& name) {
            config.precision = precision_from_name(name);
          })
      .def("check", [](const MoeConfig& config,
                       const MoeShape& shape) { can_implement(config, shape).throw_if_error(); })
      .def("check_knobs", [](const MoeConfig& config, int32_t num_ranks) {
        can_implement_knobs(config, num_ranks).throw_if_error();
      });
}

void bind_reference(nb::module_& m) {
  m.def(
      "reference_forward",
      [](const MoeShape& shape, const Array& x, const Array& top_experts,
         const Array& router_weights, const Array& w_gate, const Array& w_up, const Array& w_down,
         const OptionalArray& w_shared_gate, const OptionalArray& w_shared_up,
         const OptionalArray& w_shared_down, const Array& out, const std::string& precision,
         const ScaleArrays& weight_scales) {
        ForwardArgs args = forward_args(x, top_experts, router_weights, w_gate, w_up, w_down,
                                        w_shared_gate, w_shared_up, w_shared_down, weight_scales);
        args.out = view_of(out, "out");
        reference::Options options;
        options.precision = precision_from_name(precision);
        nb::gil_scoped_release release;
        reference::forward(shape, args, options);
      },
      "shape"_a, "x"_a, "top_experts"_a, "router_weights"_a, "w_gate"_a, "w_up"_a, "w_down"_a,
      "w_shared_gate"_a.none(), "w_shared_up"_a.none(), "w_shared_down"_a.none(), "out"_a,
      "precision"_a = "bf16", "weight_scales"_a = ScaleArrays{});
  m.def(
      "reference_backward",
      [](const MoeShape& shape, const Array& x, const Array& top_experts,
         const Array& router_weights, const Array& w_gate, const Array& w_up, const Array& w_down,
         const OptionalArray& w_shared_gate, const OptionalArray& w_shared_up,
         const OptionalArray& w_shared_down, const Array& d_out, const Array& d_x,
         const Array& d_router_weights, const OptionalArray& d_w_gate, const OptionalArray& d_w_up,
         const OptionalArray& d_w_down, const OptionalArray& d_w_shared_gate,
         const OptionalArray& d_w_shared_up, const OptionalArray& d_w_shared_down,
         const std::string& precision, const ScaleArrays& weight_scales,
         bool accumulate_weight_grads) {
        const BackwardArgs args =
            backward_args(forward_args(x, top_experts, router_weights, w_gate, w_up, w_down,
                                       w_shared_gate, w_shared_up, w_shared_down, weight_scales),
                          d_out,
                          {d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_gate,
                           d_w_shared_up, d_w_shared_down},
                          accumulate_weight_grads);
        reference::Options options;
        options.precision = precision_from_name(precision);
        nb::gil_scoped_release release;
        reference::backward(shape, args, options);
      },
      "shape"_a, "x"_a, "top_experts"_a, "router_weights"_a, "w_gate"_a, "w_up"_a, "w_down"_a,
      "w_shared_gate"_a.none(), "w_shared_up"_a.none(), "w_shared_down"_a.none(), "d_out"_a,
      "d_x"_a, "d_router_weights"_a, "d_w_gate"_a.none(), "d_w_up"_a.none(), "d_w_down"_a.none(),
      "d_w_shared_gate"_a.none(), "d_w_shared_up"_a.none(), "d_w_shared_down"_a.none(),
      "precision"_a = "bf16", "weight_scales"_a = ScaleArrays{},
      "accumulate_weight_grads"_a = false);
}

void bind_fp8_weights(nb::module_& m) {
  m.def(
      "quantize_weight_fp8",
      [](const Array& weight, const Array& codes, const Array& scales, uintptr_t stream) {
        quantize_weight_fp8(view_of(weight, "weight"), view_of(codes, "codes"),
                            view_of(scales, "scales"), stream_of(stream))
            .throw_if_error();
      },
      "weight"_a, "codes"_a, "scales"_a, "stream"_a = 0,
      "mok/fp8_weights.h: a bf16 weight [E, n, k] or [n, k] into pre-quantized codes and "
      "128 x 128 block scales (CPU, or CUDA on `stream`).");
}

void bind_gpu_layer(nb::module_& m) {
  nb::class_<GpuLayer>(m, "GpuLayer")
      .def(nb::init<const MoeShape&, const MoeConfig&>(), "shape"_a, "config"_a)
      .def(
          "forward",
          [](GpuLayer& layer, const Array& x, const Array& top_experts, const Array& router_weights,
             const Array& w_gate, const Array& w_up, const Array& w_down,
             const OptionalArray& w_shared_gate, const OptionalArray& w_shared_up,
             const OptionalArray& w_shared_down, const Array& out, uintptr_t stream,
             uint64_t weights_version, const ScaleArrays& weight_scales, bool keep_context) {
            ForwardArgs args =
                forward_args(x, top_experts, router_weights, w_gate, w_up, w_down, w_shared_gate,
                             w_shared_up, w_shared_down, weight_scales);
            args.out = view_of(out, "out");
            args.weights_version = weights_version;
            args.keep_context = keep_context;
            return layer.forward(args, stream_of(stream)).generation;
          },
          "x"_a, "top_experts"_a, "router_weights"_a, "w_gate"_a, "w_up"_a, "w_down"_a,
          "w_shared_gate"_a.none(), "w_shared_up"_a.none(), "w_shared_down"_a.none(), "out"_a,
          "stream"_a, "weights_version"_a = 0, "weight_scales"_a = ScaleArrays{},
          "keep_context"_a = true,
          "Launches the forward on `stream`; returns the context (0 never names one) that a "
          "backward of the same inputs may start from. `weights_version`: "
          "ForwardArgs::weights_version (FP8: nonzero keeps quantized weights between calls). "
          "`keep_context` false: ForwardArgs::keep_context (no backward will follow; returns 0). "
          "A float8_e4m3fn weight is pre-quantized: its 128 x 128 block scales are "
          "`weight_scales` at its index (gate, up, down, shared gate, shared up, shared down).")
      .def(
          "backward",
          [](GpuLayer& layer, const Array& x, const Array& top_experts, const Array& router_weights,
             const Array& w_gate, const Array& w_up, const Array& w_down,
             const OptionalArray& w_shared_gate, const OptionalArray& w_shared_up,
             const OptionalArray& w_shared_down, const Array& d_out, const Array& d_x,
             const Array& d_router_weights, const OptionalArray& d_w_gate,
             const OptionalArray& d_w_up, const OptionalArray& d_w_down,
             const OptionalArray& d_w_shared_gate, const OptionalArray& d_w_shared_up,
             const OptionalArray& d_w_shared_down, uintptr_t stream, uint64_t context,
             uint64_t weights_version, const ScaleArrays& weight_scales,
             bool accumulate_weight_grads) {
            ForwardArgs forward =
                forward_args(x, top_experts, router_weights, w_gate, w_up, w_down, w_shared_gate,
                             w_shared_up, w_shared_down, weight_scales);
            forward.weights_version = weights_version;
            const BackwardArgs args =
                backward_args(forward, d_out,
                              {d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_gate,
                               d_w_shared_up, d_w_shared_down},
                              accumulate_weight_grads);
            const ForwardContext forward_context{context};
            layer.backward(args, stream_of(stream), context != 0 ? &forward_context : nullptr);
          },
          "x"_a, "top_experts"_a, "router_weights"_a, "w_gate"_a, "w_up"_a, "w_down"_a,
          "w_shared_gate"_a.none(), "w_shared_up"_a.none(), "w_shared_down"_a.none(), "d_out"_a,
          "d_x"_a, "d_router_weights"_a, "d_w_gate"_a.none(), "d_w_up"_a.none(),
          "d_w_down"_a.none(), "d_w_shared_gate"_a.none(), "d_w_shared_up"_a.none(),
          "d_w_shared_down"_a.none(), "stream"_a, "context"_a = 0, "weights_version"_a = 0,
          "weight_scales"_a = ScaleArrays{}, "accumulate_weight_grads"_a = false,
          "Launches the backward on `stream`: from `context` (a forward's) if nonzero, else "
          "recomputing the forward's intermediates. Pre-quantized weights as in forward; their "
          "gradients are bf16. fp8_block: weight gradients may be fp32, and with "
          "`accumulate_weight_grads` are added to what they hold (BackwardArgs).")
      .def(
          "holds_context",
          [](const GpuLayer& layer, uint64_t context) {
            return layer.holds_context(ForwardContext{context});
          },
          "context"_a)
      .def(
          "synchronize",
          [](GpuLayer& layer, uintptr_t stream) {
            Status status;
            {
              nb::gil_scoped_release release;
              status = layer.synchronize(stream_of(stream));
            }
            status.throw_if_error();
          },
          "stream"_a,
          "Waits for `stream` and raises what the device found (bad expert ids, a timed-out "
          "wait with its diagnosis, a CUDA error).")
      .def("workspace_bytes", &GpuLayer::workspace_bytes)
      .def("timed_out_wait", &GpuLayer::timed_out_wait)
      .def_prop_ro("shape", &GpuLayer::shape)
      .def_prop_ro("config", &GpuLayer::config);
}

void bind_sm_clock(nb::module_& m) {
  nb::class_<SmClockWindow>(m, "SmClockWindow")
      .def(nb::init<>())
      .def(
          "open", [](SmClockWindow& window, uintptr_t stream) { window.open(stream_of(stream)); },
          "stream"_a)
      .def(
          "close", [](SmClockWindow& window, uintptr_t stream) { window.close(stream_of(stream)); },
          "stream"_a)
      .def("ghz", [](SmClockWindow& window) {
        nb::gil_scoped_release release;
        return window.ghz();
      });
}

#if MOK_HAS_NCCL
void bind_expert_parallel(nb::module_& m) {
  m.def("make_unique_id", [] {
    const UniqueId id = make_unique_id();
    return nb::bytes(id.bytes.data(), id.bytes.size());
  });
  nb::class_<Communicator>(m, "Communicator")
      .def_static(
          "create_rank",
          [](nb::bytes id_bytes, int32_t num_ranks, int32_t rank, int device) {
            UniqueId id;
            if (id_bytes.size() != id.bytes.size())
              throw Error(ErrorCode::kInvalidArgument,
                          "argument `unique_id` has " + std::to_string(id_bytes.size()) +
                              " bytes; an NCCL unique id has " + std::to_string(id.bytes.size()));
            std::memcpy(id.bytes.data(), id_bytes.c_str(), id.bytes.size());
            nb::gil_scoped_release release;
            return Communicator::create_rank(id, num_ranks, rank, device);
          },
          "unique_id"_a, "num_ranks"_a, "rank"_a, "device"_a)
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("num_ranks", &Communicator::num_ranks)
      .def_prop_ro("device", &Communicator::device);
  nb::class_<EpLayer>(m, "EpLayer")
      .def(
          "__init__",
          [](EpLayer* layer, const MoeShape& shape, const MoeConfig& config,
             Communicator& communicator) { new (layer) EpLayer(shape, config, {&communicator}); },
          "shape"_a, "config"_a, "communicator"_a, nb::keep_alive<1, 4>())
      .def(
          "rank_layer", [](EpLayer& layer) -> GpuLayer& { return layer.rank_layer(0); },
          nb::rv_policy::reference_internal,
          "This process's rank's layer: forward, backward and synchronize as GpuLayer's (every "
          "rank makes the same calls).")
      .def("workspace_bytes_per_rank", &EpLayer::workspace_bytes_per_rank);
}
#endif

}  // namespace

}  // namespace mok::python

NB_MODULE(_C, m) {
  using namespace mok::python;
  m.doc() = "mok's C++ layer: the CPU reference, the single-GPU layer, expert parallelism";
  // Workspaces held by module-level caches at interpreter exit are freed by mok's atexit hook;
  // the configs they keep are not leaks worth a report.
  nb::set_leak_warnings(false);
  nb::register_exception_translator(
      [](const std::exception_ptr& error, void*) { translate_errors(error); });
  bind_shape_and_config(m);
  bind_reference(m);
  bind_fp8_weights(m);
  bind_gpu_layer(m);
  bind_sm_clock(m);
#if MOK_HAS_NCCL
  m.attr("has_nccl") = true;
  bind_expert_parallel(m);
#else
  m.attr("has_nccl") = false;
#endif
}
