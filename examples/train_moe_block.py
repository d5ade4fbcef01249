"""Trains a small MoE transformer block with mok on synthetic data and prints the loss.

    python examples/train_moe_block.py --device cuda --steps 300
    python examples/train_moe_block.py --device cpu --steps 20     # mok's CPU reference: slow

The block: RMSNorm -> a top-k softmax router -> mok.nn.MoE (routed SwiGLU experts and a shared
expert) -> residual, then a linear head, regressing a fixed random teacher. Run it twice: mok is
bitwise reproducible, so the printed losses are identical (``--check-reproducible`` does both runs
and compares them).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import mok


class MoEBlock(nn.Module):
    def __init__(self, hidden, intermediate, num_experts, top_k, shared, device, precision="bf16"):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.RMSNorm(hidden, device=device, dtype=torch.bfloat16)
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=torch.float32)
        self.experts = mok.nn.MoE(
            num_experts,
            hidden,
            intermediate,
            shared_intermediate_size=shared,
            device=device,
            config=mok.MoKConfig(precision=precision),
        )
        self.head = nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        h = self.norm(x)
        logits = self.router(h.float())
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.head(x + self.experts(h, experts, weights))


def train(args) -> list[float]:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    block = MoEBlock(
        args.hidden,
        args.intermediate,
        args.experts,
        args.top_k,
        args.shared,
        device,
        args.precision,
    )
    teacher = torch.randn(args.hidden, args.hidden, device=device) / args.hidden**0.5
    optimizer = torch.optim.AdamW(block.parameters(), lr=args.lr)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.seq, args.hidden, device=device, generator=gen).to(
            torch.bfloat16
        )
        target = (x.float() @ teacher).tanh()
        loss = (block(x).float() - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % args.print_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    if device.type == "cuda":
        block.experts.workspace.synchronize()  # raises if the device found a problem
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--shared", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--check-reproducible", action="store_true")
    parser.add_argument(
        "--precision", default="bf16", help="bf16, or fp8_block (DeepSeek-V3's block-scaled e4m3)"
    )
    parser.add_argument(
        "--compare-bf16",
        action="store_true",
        help="with --precision fp8_block: also train in bf16 from the same start, compare the losses",
    )
    args = parser.parse_args()
    first = train(args)
    if args.compare_bf16 and args.precision != "bf16":
        bf16 = train(
            argparse.Namespace(**{**vars(args), "precision": "bf16", "print_every": 10**9})
        )
        gap = max(abs(a - b) / b for a, b in zip(first, bf16))
        print(
            f"{args.precision} vs bf16 from the same start: final loss {first[-1]:.6f} vs "
            f"{bf16[-1]:.6f}, largest relative gap over the run {gap:.2%}"
        )
    if args.check_reproducible:
        second = train(args)
        same = first == second
        print(f"two runs bitwise identical: {'yes' if same else 'NO'}")
        if not same:
            step = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
            print(f"first difference at step {step}: {first[step]!r} vs {second[step]!r}")
            raise SystemExit(1)


if __name__ == "__main__":
    main()
