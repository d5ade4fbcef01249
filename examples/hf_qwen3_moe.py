"""A Hugging Face Qwen3-MoE model (a small random config: no download) with
experts_implementation="mok" against "eager": the loss, the logits and the experts' gradients.
With --fp8 mok's experts train in FP8 (block-scaled e4m3), set up by one call of
mok.integrations.transformers.prepare; "eager" stays bf16.

    python examples/hf_qwen3_moe.py --device cuda [--fp8]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import mok.integrations.transformers  # noqa: F401  registers experts_implementation="mok"


def run(implementation, device, input_ids, fp8=False):
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, experts_implementation=implementation
    ).to(device)
    if fp8:
        mok.integrations.transformers.prepare(model, mok.MoKConfig(precision="fp8_block"))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    experts = model.model.layers[0].mlp.experts
    return out.loss.item(), out.logits.float(), experts.gate_up_proj.grad.float()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fp8", action="store_true", help="mok's experts in FP8 (fp8_block)")
    args = parser.parse_args()
    input_ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(1)).to(
        args.device
    )
    loss, logits, grad = run("mok", args.device, input_ids, args.fp8)
    ref_loss, ref_logits, ref_grad = run("eager", args.device, input_ids)
    mok_name = "mok FP8" if args.fp8 else "mok"
    print(f"loss: {mok_name} {loss:.6f}, eager {ref_loss:.6f}")
    print(
        f"logits relative difference: {((logits - ref_logits).norm() / ref_logits.norm()).item():.2e}"
    )
    print(
        f"experts gate_up_proj.grad relative difference: {((grad - ref_grad).norm() / ref_grad.norm()).item():.2e}"
    )


if __name__ == "__main__":
    main()
