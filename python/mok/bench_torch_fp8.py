"""The FP8 MoE layer a PyTorch user would write today: ``torch._scaled_grouped_mm`` with row-wise
e4m3 scales (one fp32 scale per row of an activation and per output column of a weight: what
that op takes on Hopper, coarser than mok's 1 x 128 / 128 x 128 blocks) for the forward GEMMs
and both dgrads, SwiGLU in bf16, and the weight gradients in bf16 through ``torch._grouped_mm``.
``python -m mok.bench --fp8`` times it beside mok in FP8 (issue 17's comparison)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_E4M3_MAX = 448.0


def _rowwise(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """e4m3 values of `t` with one fp32 scale per slice along `dim` (amax / 448), and the scales
    with `dim` removed."""
    scale = t.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-12) / _E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def _column_major(t: Tensor) -> Tensor:
    """[G, K, N] with the same values, stored column-major per group (the op's B layout)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _scaled(a: Tensor, b_kn: Tensor, scale_a: Tensor, scale_b: Tensor, offsets: Tensor) -> Tensor:
    return torch._scaled_grouped_mm(
        a, b_kn, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16
    )


class _Fp8Experts(torch.autograd.Function):
    """rows [R, H] sorted by expert (offsets: each expert's end) -> y [R, H]; gate_up
    [E, 2I, H] (gate rows, then up rows) and down [E, H, I] in bf16."""

    @staticmethod
    def forward(ctx, rows, offsets, gate_up, down):
        a, scale_a = _rowwise(rows, -1)
        # B = gate_up[e]^T as [K = H, N = 2I]: scales per output column, i.e. per row of gate_up.
        b, scale_b = _rowwise(gate_up, -1)
        gate, up = _scaled(a, b.transpose(1, 2), scale_a, scale_b, offsets).chunk(2, dim=-1)
        h = F.silu(gate) * up
        ha, scale_h = _rowwise(h, -1)
        d, scale_d = _rowwise(down, -1)
        y = _scaled(ha, d.transpose(1, 2), scale_h, scale_d, offsets)
        ctx.save_for_backward(rows, gate, up, offsets, gate_up, down)
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, gate, up, offsets, gate_up, down = ctx.saved_tensors
        dy = dy.contiguous()
        dya, scale_dy = _rowwise(dy, -1)
        # dh = dy down[e]: B = down[e] as [K = H, N = I], scales per column (over H).
        dq, scale_dq = _rowwise(down, 1)
        dh = _scaled(dya, _column_major(dq), scale_dy, scale_dq, offsets).float()
        g, u = gate.float(), up.float()
        sigmoid = torch.sigmoid(g)
        d_gate = dh * u * sigmoid * (1 + g * (1 - sigmoid))
        d_up = dh * g * sigmoid
        d_gate_up = torch.cat((d_gate, d_up), dim=-1).to(torch.bfloat16)
        # d_rows = d_gate_up gate_up[e]: B = gate_up[e] as [K = 2I, N = H], scales per column.
        dga, scale_dg = _rowwise(d_gate_up, -1)
        gq, scale_gq = _rowwise(gate_up, 1)
        d_rows = _scaled(dga, _column_major(gq), scale_dg, scale_gq, offsets)
        # Weight gradients in bf16: each expert's rows are the reduction (offsets split K).
        h = (F.silu(g) * u).to(torch.bfloat16)
        d_gate_up_w = torch._grouped_mm(d_gate_up.t(), rows, offs=offsets)
        d_down_w = torch._grouped_mm(dy.t(), h, offs=offsets)
        return d_rows, None, d_gate_up_w, d_down_w


def torch_fp8_moe(
    x: Tensor, top_experts: Tensor, router_weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """The layer: the FP8 experts in the bf16 torch pipeline's frame (``bench_peers``)."""
    from .bench_peers import sorted_moe

    return sorted_moe(
        x,
        top_experts,
        router_weights,
        gate_up.shape[0],
        lambda rows, offsets: _Fp8Experts.apply(rows, offsets, gate_up, down),
    )
