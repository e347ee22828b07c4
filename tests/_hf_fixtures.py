"""Tiny fixed-seed ``transformers`` models saved as Hugging Face directories (test fixtures, made at test time)."""

from __future__ import annotations

import os
import random

import torch

VOCAB, D, HEADS, LAYERS, POSITIONS = 128, 64, 4, 2, 64
FAMILIES = ("gpt2", "llama_gqa", "llama_tied")
RECORDS = ("qwen2", "mistral")  # families added as registry records only (meshtorch.models.hf_families)
WINDOW = 48  # the Mistral fixture's sliding_window: contexts up to 48 load, longer ones are refused


def hf_config(family: str, vocab: int = VOCAB, positions: int = POSITIONS, window: int = WINDOW):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_layer=LAYERS, n_embd=D, n_head=HEADS, vocab_size=vocab, n_positions=positions,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=None, pad_token_id=None)
    llama_like = dict(num_hidden_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=positions, bos_token_id=0,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "qwen2":  # q/k/v biases; its sliding window off (use_sliding_window=False), as Qwen2 ships
        return transformers.Qwen2Config(**llama_like, rope_theta=1000.0)
    if family == "mistral":
        return transformers.MistralConfig(**llama_like, sliding_window=window, head_dim=16)
    return transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS,
                                    num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                    max_position_embeddings=positions, tie_word_embeddings=family == "llama_tied",
                                    rope_theta=500.0 if family == "llama_gqa" else 10000.0, bos_token_id=0,
                                    eos_token_id=None, pad_token_id=None)


def make_model(family: str, seed: int = 0, vocab: int = VOCAB, positions: int = POSITIONS,
               window: int = WINDOW):
    """A randomly initialised ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``MistralForCausalLM`` (seeded), float32, eval mode (``vocab``: GPT-2's vocabulary size, e.g. an odd one that
    a mesh axis does not divide; ``positions``: the context; ``window``: Mistral's sliding window)."""
    import transformers

    torch.manual_seed(seed)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}.get(family, transformers.LlamaForCausalLM)
    m = cls(hf_config(family, vocab if family == "gpt2" else VOCAB, positions, window)).float().eval()
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


def train_dirs(root, gpt2_vocab: int = 257) -> dict:
    """The ``meshtorch train --init-from`` inputs under ``root``: ``{"gpt2": (dir, model), "llama": (dir with a BPE
    tokenizer.json, model), "data": text file}`` (GPT-2 with ``gpt2_vocab`` >= 256 tokens, for ``--tokenizer
    byte``; the Llama is ``llama_gqa``)."""
    text_ = text()
    data = os.path.join(str(root), "data.txt")
    with open(data, "w") as f:
        f.write(text_)
    llama_ref, gpt2_ref = make_model("llama_gqa"), make_model("gpt2", vocab=gpt2_vocab)
    llama = save(llama_ref, os.path.join(str(root), "llama"))
    bpe_tokenizer(os.path.join(llama, "tokenizer.json"), text_)
    return {"gpt2": (save(gpt2_ref, os.path.join(str(root), "gpt2")), gpt2_ref), "llama": (llama, llama_ref),
            "data": data}


def run(argv):
    """``meshtorch`` ``argv`` run in-process; the subcommand's return value (exceptions propagate)."""
    from meshtorch.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def cli(capsys, *argv):
    """``meshtorch`` ``argv`` through ``meshtorch.cli.main``: ``(exit status, stdout + stderr)``."""
    from meshtorch.cli import main

    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def token_batch(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_t5(seed: int = 0):
    """A T5 v1.1-shaped ``T5ForConditionalGeneration`` (gated-gelu, untied head, shared input embedding, no
    output scaling), 2+2 layers, d_model 64, 4 heads x d_kv 16, 32 relative buckets; float32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=D, d_kv=16, d_ff=96, num_layers=LAYERS, num_heads=HEADS,
                                feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, scale_decoder_outputs=False)
    m = transformers.T5ForConditionalGeneration(cfg).float()
    with torch.no_grad():  # transformers v5 ignores tie_word_embeddings=False here: untie the head by hand
        m.lm_head.weight = torch.nn.Parameter(0.05 * torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(7)))
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    m.config.tie_word_embeddings = False
    return m.eval()


def save_t5(model, path: str) -> str:
    """``save_pretrained`` with ``tie_word_embeddings: false`` in config.json, as T5 v1.1 checkpoints have it."""
    import json

    save(model, path)
    cfile = os.path.join(path, "config.json")
    cfg = json.load(open(cfile))
    cfg["tie_word_embeddings"] = False
    json.dump(cfg, open(cfile, "w"))
    return path


def t5_batch(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Ids in [2, VOCAB): no padding (0) and no EOS (1), so no attention mask is needed on either side."""
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


WORDS = "the cat sat on a mat while dogs ran in the park and birds sang over old green trees".split()


def text(seed=0, n=3000) -> str:
    """A little corpus of ``n`` words of :data:`WORDS` (seeded)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(n))


def bpe_tokenizer(path: str, corpus: str, vocab_size: int = 100):
    """A BPE ``tokenizer.json`` trained on ``corpus`` (Metaspace pre-tokenizer, ``[UNK]`` for unknown characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    tok.save(path)


def make_peaked_model(family: str, positions: int = POSITIONS, window: int = WINDOW):
    """The fixture model with q and k projections scaled x10 (attention logits x100: the largest weight of the
    last position's attention is 0.3-0.5 of 6-46 positions, not ~1/n) and the attention output x8 (so attention,
    not the token's own embedding, decides the next token). GPT-2 also gets its biases x0.03 and its position
    table x3: with the fixture's 0.1 biases its LayerNorm and MLP biases picked one token whatever the attention
    did (greedy continuations then have 20 distinct tokens of 40, not 1)."""
    m = make_model(family, positions=positions, window=window)
    with torch.no_grad():
        for layer in (m.transformer.h if family == "gpt2" else m.model.layers):
            if family == "gpt2":
                layer.attn.c_attn.weight[:, : 2 * D] *= 10.0  # Conv1D [d, 3d]: the q and k columns
                layer.attn.c_attn.bias[: 2 * D] *= 10.0
                layer.attn.c_proj.weight *= 8.0
                for name, p in layer.named_parameters():
                    if name.endswith("bias"):
                        p *= 0.03
            else:
                layer.self_attn.q_proj.weight *= 10.0
                layer.self_attn.k_proj.weight *= 10.0
                layer.self_attn.o_proj.weight *= 8.0
    if family == "gpt2":
        with torch.no_grad():
            m.transformer.ln_f.bias *= 0.03
            m.transformer.wpe.weight *= 3.0
    return m
