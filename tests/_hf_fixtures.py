"""Tiny fixed-seed ``transformers`` models saved as Hugging Face directories (test fixtures, made at test time)."""

from __future__ import annotations

import os

import torch

VOCAB, D, HEADS, LAYERS, POSITIONS = 128, 64, 4, 2, 64
FAMILIES = ("gpt2", "llama_gqa", "llama_tied")


def hf_config(family: str):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_layer=LAYERS, n_embd=D, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=None, pad_token_id=None)
    return transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS,
                                    num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                    max_position_embeddings=POSITIONS, tie_word_embeddings=family == "llama_tied",
                                    rope_theta=500.0 if family == "llama_gqa" else 10000.0, bos_token_id=0,
                                    eos_token_id=None, pad_token_id=None)


def make_model(family: str, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (seeded), float32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    m = cls(hf_config(family)).float().eval()
    with torch.no_grad():  # norm weights / biases away from their 1 / 0 init, so a wrong map shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return m


def save(model, path: str, max_shard_size=None) -> str:
    os.makedirs(path, exist_ok=True)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def token_batch(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
