"""experts_implementation="mok" in Hugging Face transformers: tiny Qwen3-MoE and Mixtral models
built from random configs (no download) give the logits and every gradient of
experts_implementation="eager" (both bf16: within bf16 tolerance), on CPU and CUDA; gpt-oss is
refused with the reason. One decoder layer: with more, bf16 rounding differences (mok's and
eager's, both ~1e-2 from float32) flip some later routing decisions, and the gradients of the
experts involved then differ by design, not by error."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mok  # noqa: E402
import mok.integrations.transformers  # noqa: E402,F401  (registers "mok")
from conftest import DEVICES, check_frozen_weights, relative_error  # noqa: E402


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
    )


def mixtral_config():
    return transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )


def run(config, implementation, device, input_ids):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, experts_implementation=implementation
    ).to(device)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make_config", [qwen3_moe_config, mixtral_config], ids=["qwen3_moe", "mixtral"]
)
def test_mok_experts_match_eager(device, make_config):
    input_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    logits, loss, grads = run(make_config(), "mok", device, input_ids)
    ref_logits, ref_loss, ref_grads = run(make_config(), "eager", device, input_ids)
    assert relative_error(logits, ref_logits) < 2e-2
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    expert_grads = [n for n in grads if "experts" in n]
    assert expert_grads, "the models' experts got no gradient"
    for name in grads:
        assert relative_error(grads[name], ref_grads[name]) < 5e-2, name


def test_gpt_oss_is_refused_with_the_reason():
    config = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        layer_types=["full_attention"],
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, experts_implementation="mok"
    )
    with pytest.raises(NotImplementedError, match="GptOssExperts"):
        model(input_ids=torch.randint(0, 256, (1, 8)))


def mok_experts(device):
    """A tiny Qwen3-MoE experts module on mok, bf16, its weights N(0, 0.05) (seed 0)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = qwen3_moe_config()
    config._experts_implementation = "mok"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    return experts


def step_inputs(device, seed):
    """x [40, 128] bf16, top_experts [40, 2] of 8, router weights, d_out: seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 128, generator=gen).to(torch.bfloat16).to(device)
    top = torch.randint(0, 8, (40, 2), generator=gen).to(device)
    weights = torch.rand(40, 2, generator=gen).to(device)
    d_out = torch.randn(40, 128, generator=gen).to(torch.bfloat16).to(device)
    return x, top, weights, d_out


def step(module, x, top, weights, d_out):
    """module's output, and the gradients of x and the router weights, for d_out."""
    leaf_x, leaf_w = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out = module(leaf_x, top, leaf_w)
    out.backward(d_out)
    return out.detach(), leaf_x.grad, leaf_w.grad


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gate_up_views_give_the_bits_of_separate_weights(device):
    """The experts module's gate_up_proj reaches mok as two expert-strided views (no copy):
    output and gradients bitwise those of mok.nn.MoE holding the halves as separate tensors."""
    experts = mok_experts(device)
    separate = mok.nn.MoE(8, 128, 128, device=device)
    separate.load_hf_experts(experts.gate_up_proj.detach(), experts.down_proj.detach())
    inputs = step_inputs(device, 2)
    got, want = step(experts, *inputs), step(separate, *inputs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(
        experts.gate_up_proj.grad, torch.cat((separate.w_gate.grad, separate.w_up.grad), dim=1)
    )
    assert torch.equal(experts.down_proj.grad, separate.w_down.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gate_up_gradient_is_written_in_place(device):
    """The backward writes the gate and up gradients into the halves of one [E, 2I, H] tensor
    (no concatenation after): the eight outputs view it, and its bits are those of the op's two
    separate gradients."""
    from mok import ops

    torch.manual_seed(3)
    E, H, I, T, K = 8, 128, 128, 40, 2
    gate_up = (0.05 * torch.randn(E, 2 * I, H)).to(torch.bfloat16).to(device)
    down = (0.05 * torch.randn(E, H, I)).to(torch.bfloat16).to(device)
    x = torch.randn(T, H).to(torch.bfloat16).to(device)
    top = torch.randint(0, E, (T, K)).to(torch.int32).to(device)
    weights = torch.rand(T, K).to(device)
    d_out = torch.randn(T, H).to(torch.bfloat16).to(device)
    args = (d_out, x, top, weights, gate_up[:, :I], gate_up[:, I:], down, None, None, None)
    space = mok.functional._default_workspace(mok.functional._DEFAULT_CONFIG)
    rest = (float("inf"), space.handle, False, [])
    grads, d_gate_up = ops.backward_fused_gate_up_eager(*args, *rest)
    separate = ops.backward_eager(*args, *rest)
    assert d_gate_up.shape == (E, 2 * I, H) and d_gate_up.is_contiguous()
    assert grads[2].data_ptr() == d_gate_up.data_ptr()
    assert grads[3].data_ptr() == d_gate_up[:, I:].data_ptr()
    assert torch.equal(d_gate_up, torch.cat((separate[2], separate[3]), dim=1))
    for got, want in zip(grads[:2] + grads[4:5], separate[:2] + separate[4:5]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_experts_under_bf16_autocast_give_the_bf16_bits(device):
    """An fp32 model under torch.autocast(dtype=torch.bfloat16) (the Trainer's bf16=True): the
    experts run on bf16 copies of gate_up_proj and down_proj, with the bf16 experts' output and
    gradients (those in fp32)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    bf16 = mok_experts(device)
    fp32 = Qwen3MoeExperts(bf16.config).to(device, torch.float32)
    with torch.no_grad():
        for a, b in zip(fp32.parameters(), bf16.parameters()):
            a.copy_(b.float())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 128, generator=gen).to(torch.bfloat16).to(device)
    top = torch.randint(0, 8, (40, 2), generator=gen).to(device)
    weights = torch.rand(40, 2, generator=gen).to(device)
    d_out = torch.randn(40, 128, generator=gen).to(torch.bfloat16).to(device)
    out_ref = bf16(x, top, weights)
    out_ref.backward(d_out)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = fp32(x.float(), top, weights)
    out.backward(d_out)
    assert torch.equal(out, out_ref)
    for a, b in zip(fp32.parameters(), bf16.parameters()):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad.float())


@pytest.mark.parametrize("device", DEVICES)
def test_deepcopy_of_mok_experts_after_a_call(device):
    """copy.deepcopy of an experts module that has run (and so holds its mok workspace): the copy
    runs with a workspace of its own and gives the same output."""
    import copy

    experts = mok_experts(device)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(24, 128, generator=gen).to(torch.bfloat16).to(device)
    top = torch.randint(0, 8, (24, 2), generator=gen).to(device)
    weights = torch.rand(24, 2, generator=gen).to(device)
    want = experts(x, top, weights)
    copied = copy.deepcopy(experts)
    assert copied._mok_workspace is not experts._mok_workspace
    assert torch.equal(copied(x, top, weights), want)


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_experts_skip_their_weight_gradients(device):
    """Frozen experts (requires_grad False on gate_up_proj and down_proj, as a fine-tune of the
    attention or of adapters leaves them): the same input and router-weight gradients as
    trainable experts, and no weight gradients."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(24, 128, generator=gen).to(torch.bfloat16).to(device)
    top = torch.randint(0, 8, (24, 2), generator=gen).to(device)
    weights = torch.rand(24, 2, generator=gen).to(device)
    check_frozen_weights(mok_experts(device), x, top, weights)


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_with_an_fp8_config_runs_the_fp8_layer(device):
    """prepare(model, MoKConfig(precision="fp8_block")): the experts module runs mok's FP8 layer
    on its fused gate_up_proj's halves, with the output and gradients bitwise those of an FP8
    mok.nn.MoE holding the halves as separate tensors, and not those of the bf16 layer."""
    fp8 = mok.MoKConfig(precision="fp8_block")
    experts = mok.integrations.transformers.prepare(mok_experts(device), fp8)
    assert experts._mok_workspace.config.precision == "fp8_block"
    separate = mok.nn.MoE(8, 128, 128, device=device, config=fp8)
    separate.load_hf_experts(experts.gate_up_proj.detach(), experts.down_proj.detach())
    inputs = step_inputs(device, 13)

    got, want = step(experts, *inputs), step(separate, *inputs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(
        experts.gate_up_proj.grad, torch.cat((separate.w_gate.grad, separate.w_up.grad), dim=1)
    )
    assert torch.equal(experts.down_proj.grad, separate.w_down.grad)

    bf16 = step(mok_experts(device), *inputs)
    assert not torch.equal(got[0], bf16[0])
    # FP8's block-quantized operands against bf16's: a few percent (docs/design.md, FP8).
    assert relative_error(got[0], bf16[0]) < 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make_config", [qwen3_moe_config, mixtral_config], ids=["qwen3_moe", "mixtral"]
)
def test_models_trained_in_fp8_track_eager_bf16(device, make_config):
    """A whole model with prepare(model, MoKConfig(precision="fp8_block")): every experts module
    runs FP8; the logits and loss stay within bf16's bounds of eager bf16, and every gradient
    within FP8's (the experts' ~6-7% on the CPU reference: the recipe's 1 x 128 and 128 x 128
    quantization of each GEMM operand; docs/design.md, FP8)."""
    input_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        make_config(), dtype=torch.bfloat16, experts_implementation="mok"
    ).to(device)
    mok.integrations.transformers.prepare(model, mok.MoKConfig(precision="fp8_block"))
    spaces = [m._mok_workspace for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert spaces and all(space.config.precision == "fp8_block" for space in spaces)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    ref_logits, ref_loss, ref_grads = run(make_config(), "eager", device, input_ids)
    assert relative_error(out.logits.detach(), ref_logits) < 2e-2
    assert abs(out.loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert relative_error(grads[name], ref_grads[name]) < 0.1, name


def test_fp8_weights_keep_their_name_while_unchanged(monkeypatch):
    """By default every FP8 call quantizes the weights (version 0). With weights_version "auto"
    the halves of gate_up_proj, new views every call, carry gate_up_proj's name, so the version
    is the same while gate_up_proj is unchanged (its quantization kept between micro-batches)
    and changes once an optimizer updates it in place."""
    from mok import ops
    from mok.integrations.transformers import _halves

    # The version is computed for CUDA calls; on a machine without a GPU, no stream captures.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    experts = mok.integrations.transformers.prepare(
        mok_experts("cpu"), mok.MoKConfig(precision="fp8_block")
    )
    space = experts._mok_workspace

    def version():
        return ops._weights_version(space, (*_halves(experts.gate_up_proj, 128), experts.down_proj))

    assert space.weights_version == 0 and version() == 0
    mok.integrations.transformers.prepare(experts, weights_version="auto")
    assert experts._mok_workspace is space and space.weights_version == "auto"
    first = version()
    assert first != 0 and version() == first
    with torch.no_grad():
        experts.gate_up_proj.mul_(0.5)
    assert version() != first

    def unnamed():  # views made anew, as each call makes them, without the name
        gate_up = experts.gate_up_proj
        return ops._weights_version(space, (gate_up[:, :128], gate_up[:, 128:], experts.down_proj))

    assert unnamed() != unnamed()


_FP8_EXPERTS_CLASS = []


def fp8_checkpoint_experts(device, scale_fmt="float", swiglu_limit=None, **kwargs):
    """A tiny Qwen3-MoE experts module as transformers builds it for a model loaded in
    fine-grained FP8 (FP8Experts over its FP8 experts interface), its codes and scales those of
    N(0, 0.05) bf16 weights (seed 0) quantized in 128 x 128 blocks; with the codes and scales
    as mok's contiguous (codes, scales) pairs."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    if not _FP8_EXPERTS_CLASS:  # the decorator rewrites the class: once, as a model load does
        _FP8_EXPERTS_CLASS.append(
            use_experts_implementation(
                experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS
            )
        )
    config = qwen3_moe_config()
    config._experts_implementation = "mok"
    if swiglu_limit is not None:
        config.swiglu_limit = swiglu_limit
    args = {"block_size": (128, 128), "scale_fmt": scale_fmt, **kwargs}
    experts = _FP8_EXPERTS_CLASS[0](config, **args).to(device)
    torch.manual_seed(0)
    gate_up = (0.05 * torch.randn(8, 256, 128)).to(torch.bfloat16).to(device)
    down = (0.05 * torch.randn(8, 128, 128)).to(torch.bfloat16).to(device)
    pairs = []
    with torch.no_grad():
        for weight, codes, scales in (
            (gate_up, experts.gate_up_proj, experts.gate_up_proj_scale_inv),
            (down, experts.down_proj, experts.down_proj_scale_inv),
        ):
            q_codes, q_scales = mok.functional.quantize_weight(weight)
            if scales.shape == q_scales.shape:  # else a layout the tests see refused
                codes.copy_(q_codes)
                scales.copy_(q_scales.to(scales.dtype))  # powers of two: exact in UE8M0
            pairs.append((q_codes, q_scales))
    (gate_up_codes, gate_up_scales), down_pair = pairs
    halves = [
        (gate_up_codes[:, s].contiguous(), gate_up_scales[:, b].contiguous())
        for s, b in ((slice(0, 128), slice(0, 1)), (slice(128, 256), slice(1, 2)))
    ]
    return experts, (*halves, down_pair)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("swiglu_limit", [None, 0.25])
def test_fp8_checkpoint_experts_run_mok_fp8_on_their_codes(device, scale_fmt, swiglu_limit):
    """A model loaded in FP8 with experts_implementation="mok": its FP8Experts run mok's FP8
    layer on the checkpoint's own codes (the gate and up halves of gate_up_proj read in place as
    expert-strided views) and scales (fp32 or UE8M0): output and input gradients bitwise those
    of mok.functional.moe on contiguous (codes, scales) pairs, within FP8's bounds of the bf16
    experts, the config's swiglu_limit applied, and no gradient for the codes or scales."""
    experts, pairs = fp8_checkpoint_experts(device, scale_fmt, swiglu_limit)
    x, top, weights, d_out = step_inputs(device, 17)
    fp8 = mok.MoKConfig(precision="fp8_block")

    def want_module(leaf_x, top_experts, leaf_w):
        return mok.functional.moe(
            leaf_x, top_experts, leaf_w, *pairs, swiglu_limit=swiglu_limit, config=fp8
        )

    got, want = (
        step(experts, x, top, weights, d_out),
        step(want_module, x, top, weights, d_out),
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert experts._mok_workspace.config.precision == "fp8_block"
    assert experts.gate_up_proj.grad is None and experts.gate_up_proj_scale_inv.grad is None
    assert experts.down_proj.grad is None and experts.down_proj_scale_inv.grad is None

    def dequantized(codes, scales):  # exact in bf16: 3 mantissa bits times a power of two
        blocks = scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return (codes.float() * blocks).to(torch.bfloat16)

    bf16 = mok.functional.moe(
        x, top, weights, *(dequantized(*p) for p in pairs), swiglu_limit=swiglu_limit
    )
    # The activations' 1 x 128 quantization alone separates them: a few percent.
    assert relative_error(got[0], bf16) < 0.1 and not torch.equal(got[0], bf16)


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"block_size": (64, 64)}, "blocks of \\[64, 64\\]"),
        ({"activation_scheme": "static"}, "static scales"),
    ],
)
def test_fp8_checkpoint_layouts_mok_cannot_serve_are_refused(kwargs, why):
    experts, _ = fp8_checkpoint_experts("cpu", **kwargs)
    x, top, weights, _ = step_inputs("cpu", 19)
    with pytest.raises(NotImplementedError, match=f"FP8Experts: its .*{why}"):
        experts(x, top, weights)


def test_fp8_checkpoint_scales_are_read_again_unless_the_version_says_otherwise():
    """The scales' fp32 copies: made every call by default, so a write through ``.data`` (which
    no version counter sees) is picked up by the next call; with weights_version "auto" they
    are kept until the scale tensor's version counter moves (the mode's contract)."""
    experts, _ = fp8_checkpoint_experts("cpu")
    x, top, weights, _ = step_inputs("cpu", 23)
    scales = experts.gate_up_proj_scale_inv
    with torch.no_grad():
        first = experts(x, top, weights)
        scales.data.mul_(2.0)
        doubled = experts(x, top, weights)
        assert not torch.equal(doubled, first)

        mok.integrations.transformers.prepare(experts, weights_version="auto")
        assert torch.equal(experts(x, top, weights), doubled)
        scales.data.mul_(0.5)  # unseen by the version counter: the kept copies stay
        assert torch.equal(experts(x, top, weights), doubled)
        scales.mul_(1.0)  # in place on the parameter: its version counter moves
        assert torch.equal(experts(x, top, weights), first)
