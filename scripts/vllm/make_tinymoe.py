"""Write a tiny random Qwen3-MoE checkpoint for vLLM (no download): 3 MoE layers, top-2 of 8.

Usage: python make_tinymoe.py MODEL_DIR

Shapes are chosen for vLLM's CPU build: the CPU attention backend supports head sizes 32, 64,
80, ...; vocabulary 512 keeps the embedding small. Every layer is sparse (decoder_sparse_step=1,
no mlp_only_layers), so the routes have no dense rows. Seeded: the same weights every run.
"""

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main(out: str) -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".vllm/tinymoe")
