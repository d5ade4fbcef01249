"""mok.nn.MoE: parameters in mok's layouts, training with a torch optimizer, bitwise
reproducible training, torch.compile(fullgraph=True) without a graph break, Hugging Face
weights, and (CUDA) a whole training step captured in a CUDA graph and replayed with new
routing."""

from __future__ import annotations

import pytest
import torch

import mok
from conftest import DEVICES, check_frozen_weights, cuda_reason


def routing(T, E, K, seed, device):
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    return top.to(device), weights.to(device)


def make_module(device, shared=64, seed=0):
    torch.manual_seed(seed)
    return mok.nn.MoE(8, 128, 128, shared_intermediate_size=shared, device=device)


def train(device, steps=5, compile_backend=None, seed=0):
    module = make_module(device, seed=seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16).to(device)

    def loss_of(x, top, weights):
        out = module(x, top, weights)
        return (out.float() - target.float()).pow(2).mean()

    if compile_backend is not None:  # the forward and (AOT autograd) its backward, one graph each
        loss_of = torch.compile(loss_of, fullgraph=True, backend=compile_backend)
    x = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16).to(device)
    losses = []
    for i in range(steps):
        top, weights = routing(64, 8, 2, i % 2, device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(x, top.view(2, 32, 2), weights.view(2, 32, 2))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weights_under_bf16_autocast_give_the_bf16_bits(device):
    """fp32 master weights (module.float()) under torch.autocast(dtype=torch.bfloat16): the
    layer runs on bf16 copies, so its output is the bf16 module's, bit for bit, and every
    gradient is the bf16 module's in fp32. Without autocast fp32 weights are refused."""
    reference = make_module(device)
    master = make_module(device).float()
    with torch.no_grad():
        for a, b in zip(master.parameters(), reference.parameters()):
            a.copy_(b.float())
    top, weights = routing(48, 8, 2, 3, device)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(48, 128, generator=gen).to(torch.bfloat16).to(device)
    d_out = torch.randn(48, 128, generator=gen).to(torch.bfloat16).to(device)

    x_ref = x.clone().requires_grad_(True)
    out_ref = reference(x_ref, top, weights)
    out_ref.backward(d_out)
    x_master = x.float().requires_grad_(True)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = master(x_master, top, weights)
    out.backward(d_out)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_ref)
    assert x_master.grad.dtype == torch.float32 and torch.equal(x_master.grad, x_ref.grad.float())
    for (name, a), b in zip(master.named_parameters(), reference.parameters()):
        assert a.grad.dtype == torch.float32, name
        assert torch.equal(a.grad, b.grad.float()), name
    with pytest.raises(ValueError, match="bfloat16|bf16"):
        master(x.float(), top, weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(device, reentrant):
    """torch.utils.checkpoint around the module (its forward runs again inside the backward):
    the same gradients, bit for bit, as without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    module = make_module(device)
    top, weights = routing(32, 8, 2, 5, device)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x = x.to(device)

    def grads(checkpointed):
        for p in module.parameters():
            p.grad = None
        leaf_x, leaf_w = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        if checkpointed:
            out = checkpoint(module, leaf_x, top, leaf_w, use_reentrant=reentrant)
        else:
            out = module(leaf_x, top, leaf_w)
        out.float().pow(2).mean().backward()
        return [leaf_x.grad, leaf_w.grad] + [p.grad.clone() for p in module.parameters()]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_deepcopy_and_torch_save_give_a_working_module(device):
    """copy.deepcopy (an EMA copy of the model) and torch.save / torch.load of the module: the
    copy computes the same bits with a workspace of its own (same config, nothing built)."""
    import copy
    import io

    module = make_module(device)
    top, weights = routing(32, 8, 2, 7, device)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.to(device)
    want = module(x, top, weights)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(module), torch.load(buffer, weights_only=False)):
        assert copied.workspace is not module.workspace
        assert copied.workspace.handle != module.workspace.handle
        assert copied.workspace.config.minibatch_size == module.workspace.config.minibatch_size
        assert torch.equal(copied(x, top, weights), want)


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_weights_skip_their_gradients(device):
    """Every weight frozen (requires_grad False: a fine-tune of the router or the attention):
    the backward computes d_x and the router weights' gradient alone, bit for bit those of the
    full backward, and leaves the weights without gradients."""
    module = make_module(device)
    top, weights = routing(32, 8, 2, 9, device)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    x = x.to(device)
    check_frozen_weights(module, x, top, weights)
    # The op itself leaves the six weight gradients empty: not computed.
    from mok import ops

    params = [module.w_gate, module.w_up, module.w_down]
    params += [module.w_shared_gate, module.w_shared_up, module.w_shared_down]
    d_out = torch.ones(32, 128, dtype=torch.bfloat16, device=device)
    outputs = ops.backward_eager(
        d_out, x, top, weights, *params, float("inf"), module.workspace.handle, False, [], False
    )
    assert all(g.numel() == 0 for g in outputs[2:])
    assert torch.equal(
        outputs[0],
        ops.backward_eager(
            d_out, x, top, weights, *params, float("inf"), module.workspace.handle, False, []
        )[0],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_and_layouts(device):
    module = make_module(device)
    names = [n for n, _ in module.named_parameters()]
    assert names == ["w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down"]
    assert tuple(module.w_gate.shape) == (8, 128, 128) and module.w_gate.dtype == torch.bfloat16
    assert [n for n, _ in make_module(device, shared=0).named_parameters()] == [
        "w_gate",
        "w_up",
        "w_down",
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_training_lowers_the_loss_and_is_bitwise_reproducible(device):
    losses, params = train(device, steps=8)
    assert losses[-1] < losses[0]
    losses_again, params_again = train(device, steps=8)
    assert losses == losses_again
    for a, b in zip(params, params_again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    """The module compiled with fullgraph=True (no graph break; Inductor on CUDA, aot_eager on
    CPU): its output and every gradient bitwise equal to eager."""
    backend = "aot_eager" if device == "cpu" else "inductor"
    module = make_module(device)
    x = torch.randn(64, 128).to(torch.bfloat16).to(device).requires_grad_(True)
    top, weights = routing(64, 8, 2, 0, device)
    d_out = torch.randn(64, 128).to(torch.bfloat16).to(device)

    def run(fn):
        for leaf in [x, *module.parameters()]:
            leaf.grad = None
        out = fn(x, top, weights)
        out.backward(d_out)
        return [out.detach()] + [leaf.grad.clone() for leaf in [x, *module.parameters()]]

    eager = run(module)
    compiled = run(torch.compile(module, fullgraph=True, backend=backend))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_load_hf_experts(device):
    module = make_module(device, shared=0)
    E, I, H = 8, 128, 128
    gate_up = torch.randn(E, 2 * I, H).to(torch.bfloat16).to(device)
    down = torch.randn(E, H, I).to(torch.bfloat16).to(device)
    module.load_hf_experts(gate_up, down)
    assert torch.equal(module.w_gate, gate_up[:, :I]) and torch.equal(module.w_up, gate_up[:, I:])
    assert torch.equal(module.w_down, down)
    with pytest.raises(ValueError, match="gate_up_proj"):
        module.load_hf_experts(gate_up[:, :I], down)


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
def test_cuda_graph_training_step_replays_with_new_routing():
    module = make_module("cuda")
    T, K, E = 64, 2, 8
    static_x = torch.randn(T, 128, device="cuda").to(torch.bfloat16)
    static_top, static_w = routing(T, E, K, 0, "cuda")

    def step():
        out = module(static_x, static_top, static_w)
        out.float().pow(2).mean().backward()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # the workspace is allocated here, before capture
        for p in module.parameters():
            p.grad = None
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static_grads = [p.grad for p in module.parameters()]  # written by every replay
    for seed in (3, 4):
        top, w = routing(T, E, K, seed, "cuda")
        static_top.copy_(top)
        static_w.copy_(w)
        graph.replay()
        replayed = [g.clone() for g in static_grads]
        for p in module.parameters():
            p.grad = None
        step()
        eager = [p.grad for p in module.parameters()]
        for a, b in zip(replayed, eager):
            assert torch.equal(a, b)
        for p in module.parameters():
            p.grad = None


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
def test_fp8_cuda_graph_step_requantizes_updated_weights():
    """FP8 (precision="fp8_block") in a captured training step that updates its weights in
    place: every replay quantizes the weights it updated (no weights kept across a capture), so
    two replays give the gradients of two eager steps from the same start, bit for bit."""
    torch.manual_seed(5)
    config = mok.MoKConfig(precision="fp8_block")
    module = mok.nn.MoE(8, 128, 128, shared_intermediate_size=128, device="cuda", config=config)
    T, K, E = 128, 2, 8
    static_x = torch.randn(T, 128, device="cuda").to(torch.bfloat16)
    static_top, static_w = routing(T, E, K, 0, "cuda")
    start = [p.detach().clone() for p in module.parameters()]

    def step():
        out = module(static_x, static_top, static_w)
        out.float().pow(2).mean().backward()
        with torch.no_grad():
            for p in module.parameters():
                p.sub_(p.grad, alpha=1e-2)

    def restore():
        with torch.no_grad():
            for p, s in zip(module.parameters(), start):
                p.copy_(s)
                p.grad = None

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # the workspace is allocated here, before capture
    torch.cuda.current_stream().wait_stream(stream)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static_grads = [p.grad for p in module.parameters()]
    restore_values = [s.clone() for s in start]
    with torch.no_grad():
        for p, s in zip(module.parameters(), restore_values):
            p.copy_(s)
    replayed = []
    for _ in range(2):
        graph.replay()
        replayed.append([g.clone() for g in static_grads])
    restore()
    eager = []
    for _ in range(2):
        step()
        eager.append([p.grad.clone() for p in module.parameters()])
        for p in module.parameters():
            p.grad = None
    for replay_grads, eager_grads in zip(replayed, eager):
        for a, b in zip(replay_grads, eager_grads):
            assert torch.equal(a, b)
