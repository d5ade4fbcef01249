"""mok.functional: the differentiable ``moe`` against an independent float64 torch
implementation (outputs and every gradient, on the routings that break MoE layers), MoK's
functional API called with MoK's signatures, bitwise reproducibility, and bad inputs."""

from __future__ import annotations

import pytest
import torch

import mok.functional as F
from conftest import DEVICES, as_float64, make_problem, relative_error, torch_moe

WEIGHTS = ["w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down"]
# bf16 storage of h, g, u and the outputs: mok's errors sit near 3e-3 (docs/design.md).
TOLERANCE = 1e-2


def as_leaves(p):
    """The problem with every floating-point tensor a fresh leaf that requires grad."""
    return {
        k: (
            v.detach().requires_grad_(True)
            if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v
        )
        for k, v in p.items()
    }


def step_results(leaves):
    """A training step's output and the gradients of x, the router weights and the weights, after
    a backward of ones through mok on `leaves` (as_leaves)."""
    out = moe_of(leaves)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [leaves[n].grad for n in ["x", "router_weights"] + WEIGHTS]


def moe_of(p, swiglu_limit=None):
    return F.moe(
        p["x"],
        p["top_experts"],
        p["router_weights"],
        p["w_gate"],
        p["w_up"],
        p["w_down"],
        p["w_shared_gate"],
        p["w_shared_up"],
        p["w_shared_down"],
        swiglu_limit=swiglu_limit,
    )


CASES = {
    "random": dict(),
    "shared_expert": dict(Is=192),
    "clamp": dict(),  # ~1% of g clamped: where bf16 rounding moves g across L, the exact gradient jumps
    "holes": dict(routing="holes"),
    "signed_and_zero_weights": dict(routing="signed"),
    "duplicate_experts_in_a_row": dict(routing="duplicates"),
    "all_to_one_expert": dict(routing="one_expert"),
    "int64_ids_odd_tokens": dict(int64_ids=True, T=37),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_matches_float64_torch(device, case):
    limit = 1.5 if case == "clamp" else None
    p = make_problem(device, seed=len(case), **CASES[case])
    leaves = as_leaves(p)
    out = moe_of(leaves, limit)
    d_out = (
        torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        .to(torch.bfloat16)
        .to(device)
    )
    out.backward(d_out)

    exact = as_float64(p, requires_grad=True)
    expected = torch_moe(exact, limit)
    expected.backward(d_out.double())

    assert out.dtype == torch.bfloat16 and out.shape == p["x"].shape
    assert relative_error(out, expected) < TOLERANCE
    for name in ["x", "router_weights"] + WEIGHTS:
        if p.get(name) is None:
            continue
        got, want = leaves[name].grad, exact[name].grad
        assert got is not None and got.shape == want.shape, name
        assert relative_error(got, want) < TOLERANCE, (name, relative_error(got, want))
    if case == "holes":  # slots routed nowhere get exactly zero gradient
        unrouted = p["top_experts"] < 0
        assert torch.all(leaves["router_weights"].grad[unrouted] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_reproducible(device):
    p = make_problem(device, Is=64, seed=3)
    runs = []
    for _ in range(2):
        leaves = as_leaves(p)
        runs.append(step_results(leaves))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_without_autograd_gives_the_same_bits(device):
    """Under torch.no_grad (and with nothing requiring a gradient) the forward keeps no context
    (ForwardArgs::keep_context): the same output; a training step after it recomputes to the
    same gradients."""
    p = make_problem(device, Is=64, seed=5)
    leaves = as_leaves(p)
    want = step_results(leaves)
    assert F._records_graph(leaves["x"])
    with torch.no_grad():
        assert not F._records_graph(leaves["x"])
        assert torch.equal(moe_of(leaves), want[0])
    assert torch.equal(moe_of(p), want[0])  # plain tensors: nothing to differentiate
    for leaf in leaves.values():
        if isinstance(leaf, torch.Tensor):
            leaf.grad = None
    for a, b in zip(step_results(leaves), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_mok_functional_signatures(device):
    """MoK's call sequence, argument for argument: config, workspace, schedule, forward,
    backward (8 gradients in MoK's order), recompute_forward_context."""
    p = make_problem(device, Is=128, seed=5)
    T, H = p["x"].shape
    K = p["top_experts"].shape[1]
    config = F.MoKConfig(minibatch_size=256, macrobatch_size=1024)
    workspace = F.get_workspace(
        config, None, device=torch.device(device), num_local_tokens=T, hidden_size=H, topk=K
    )
    assert (
        F.get_workspace(
            config, None, device=torch.device(device), num_local_tokens=T, hidden_size=H, topk=K
        )
        is workspace
    )
    schedule = F.build_schedule(workspace, config, p["top_experts"], num_local_experts=4)
    assert int(schedule.tokens_per_expert.sum()) == int((p["top_experts"] >= 0).sum())
    weights = (
        p["w_shared_gate"],
        p["w_shared_up"],
        p["w_shared_down"],
        p["w_gate"],
        p["w_up"],
        p["w_down"],
    )
    out, context = F.forward(config, workspace, schedule, p["x"], p["router_weights"], *weights)
    d_out = torch.randn_like(out)
    grads = F.backward(
        config, workspace, schedule, context, d_out, p["x"], p["router_weights"], *weights
    )
    assert len(grads) == 8
    recomputed = F.recompute_forward_context(
        config,
        workspace,
        schedule,
        p["x"],
        p["w_shared_gate"],
        p["w_shared_up"],
        p["w_gate"],
        p["w_up"],
    )
    grads_recomputed = F.backward(
        config, workspace, schedule, recomputed, d_out, p["x"], p["router_weights"], *weights
    )
    for a, b in zip(grads, grads_recomputed):
        assert torch.equal(a, b)
    if device == "cuda":
        F.synchronize(workspace)
    leaves = as_float64(p, requires_grad=True)
    expected = torch_moe(leaves)
    expected.backward(d_out.double())
    assert relative_error(out, expected) < TOLERANCE
    names = [
        "x",
        "router_weights",
        "w_gate",
        "w_up",
        "w_down",
        "w_shared_gate",
        "w_shared_up",
        "w_shared_down",
    ]
    for name, grad in zip(names, grads):
        assert relative_error(grad, leaves[name].grad) < TOLERANCE, name


def bad(p, **changes):
    q = dict(p)
    q.update(changes)
    return q


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: bad(p, x=p["x"].float()), "`x`"),
        (lambda p: bad(p, w_down=p["w_down"][:, :, :64].contiguous()), "`w_down`"),
        (
            lambda p: bad(p, w_down=p["w_down"].transpose(1, 2).contiguous().transpose(1, 2)),
            "`w_down`",
        ),
        (lambda p: bad(p, router_weights=p["router_weights"].double()), "`router_weights`"),
        (lambda p: bad(p, top_experts=p["top_experts"].float()), "`top_experts`"),
        (lambda p: bad(p, x=p["x"].t().contiguous().t()), "`x`"),
        (lambda p: bad(p, w_up=p["w_up"][:3]), "`w_up`"),
        (lambda p: bad(p, x=p["x"][:, :64]), "`x`"),
    ],
    ids=[
        "dtype",
        "shape",
        "non_contiguous",
        "router_dtype",
        "ids_dtype",
        "strided_x",
        "mismatched_experts",
        "hidden",
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(device, change, message):
    p = change(make_problem(device))
    with pytest.raises(ValueError, match=message.replace("`", ".")):
        moe_of(p)


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_made_for_other_sizes_is_refused(device):
    p = make_problem(device)
    config = F.MoKConfig()
    workspace = F.create_workspace(
        config, None, device=torch.device(device), num_local_tokens=16, hidden_size=128, topk=2
    )
    schedule = F.build_schedule(workspace, config, p["top_experts"], num_local_experts=4)
    weights = (None, None, None, p["w_gate"], p["w_up"], p["w_down"])
    with pytest.raises(ValueError, match="num_local_tokens=16"):
        F.forward(config, workspace, schedule, p["x"], p["router_weights"], *weights)


def test_expert_id_out_of_range_is_named_on_cpu():
    p = make_problem("cpu")
    p["top_experts"][5, 1] = 9
    with pytest.raises(ValueError, match="top_experts"):
        moe_of(p)


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device):
    """T = 0 (a rank with no tokens this step): an empty output and exactly zero weight
    gradients, also through PyTorch's [0, H] gradient with strides [0, 0]."""
    p = make_problem(device, T=0, Is=64)
    leaves = as_leaves(p)
    out = moe_of(leaves)
    assert out.shape == (0, 128)
    out.float().sum().backward()
    for name in WEIGHTS:
        assert torch.count_nonzero(leaves[name].grad) == 0, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(minibatch_size=100),
            r"minibatch_size = 100; valid: 0 \(sized from the shape\) or a positive multiple of 128",
        ),
        (dict(wait_timeout_s=0.0), r"wait_timeout_s = 0"),
        (dict(macrobatch_size=100), r"macrobatch_size = 100; valid: 0 \(sized from the shape\)"),
        (dict(gemm_tile_group=0), r"gemm_tile_group = 0; valid: 1 to 1024 row tiles"),
        (
            dict(gemm_expert_groups=16),
            r"gemm_expert_groups = 16 with precision = bf16; valid: gemm_expert_groups = 0",
        ),
        (dict(fp8_row_tile_rows=64), r"fp8_row_tile_rows = 64; valid: 0 \(automatic\), 128 or 192"),
        (
            dict(fp8_row_tile_rows=192),
            r"fp8_row_tile_rows = 192 with precision = bf16; valid: fp8_row_tile_rows = 128",
        ),
        (
            dict(fp8_weight_grad_staging_tiles=3),
            r"fp8_weight_grad_staging_tiles = 3; valid: 1 or 2",
        ),
        (
            dict(fp8_weight_grad_staging_tiles=2),
            r"fp8_weight_grad_staging_tiles = 2 with precision = bf16; valid: "
            r"fp8_weight_grad_staging_tiles = 1",
        ),
    ],
)
def test_bad_config_is_refused_on_every_device(device, fields, message):
    """A knob out of range is refused when the workspace is made, naming the field and what is
    valid, on the CPU as on CUDA."""
    with pytest.raises(ValueError, match=message):
        F.create_workspace(
            F.MoKConfig(**fields),
            device=torch.device(device),
            num_local_tokens=8,
            hidden_size=64,
            topk=2,
        )


def test_config_switches_reach_the_native_config():
    """Every on/off knob of MoKConfig is carried into the C++ layer's config, both ways."""
    switches = [
        "persistent_forward",
        "persistent_backward",
        "gemm_cta_pairs",
        "gemm_wide_tiles",
        "gemm_l2_placement",
        "gemm_four_stages",
        "gemm_auto_lockstep",
        "gemm_expert_aligned_groups",
        "gemm_dgrad_half_row_tiles",
        "gemm_tiles_by_ticket",
        "swiglu_backward_in_dgrad",
        "skip_padding_rows",
        "weight_grad_pingpong",
        "overlap_kernel_launches",
        "check_finite",
        "ep_dispatch_in_gemm",
    ]
    default = F.MoKConfig()
    for name in switches:
        flipped = F.MoKConfig(**{name: not getattr(default, name)})
        native = flipped.to_native()
        assert getattr(native, name) == getattr(flipped, name), name
        for other in switches:
            if other != name:
                assert getattr(native, other) == getattr(default, other), (name, other)
    assert F.MoKConfig(gemm_tile_group=3).to_native().gemm_tile_group == 3
    assert F.MoKConfig(gemm_expert_groups=16).to_native().gemm_expert_groups == 16
    assert F.MoKConfig(fp8_row_tile_rows=192).to_native().fp8_row_tile_rows == 192
    staging = F.MoKConfig(fp8_weight_grad_staging_tiles=2).to_native()
    assert staging.fp8_weight_grad_staging_tiles == 2
    assert F.MoKConfig().to_native().fp8_swiglu == "gate-up-without-context"
    assert F.MoKConfig(fp8_gather_in_gate_up=True).to_native().fp8_gather_in_gate_up is True
    for place in ("pass", "gate-up"):
        assert F.MoKConfig(fp8_swiglu=place).to_native().fp8_swiglu == place
    with pytest.raises(ValueError, match="fp8_swiglu 'epilogue' is unknown; valid: pass, "):
        F.MoKConfig(fp8_swiglu="epilogue").to_native()
    assert F.MoKConfig(gemm_lockstep_k_blocks=16).to_native().gemm_lockstep_k_blocks == 16
