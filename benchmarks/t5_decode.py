"""Milliseconds per new T5 token: meshtorch's encoder-decoder KV-cache decoder
(:func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`) vs ``transformers``' ``T5ForConditionalGeneration`` with
``past_key_values``, on the same T5 v1.1-shaped model (random weights, float32, batch 1), interleaved.

Per new token, in turn: one meshtorch cache step (:class:`meshtorch.runtime.generate.CachedDecoder`) and one
``transformers`` decoder forward of one token with its ``past_key_values`` and the encoder's output (what
``generate(use_cache=True)`` runs per token); then, ``--repeats`` times in turn, a whole greedy decode of ``--new``
tokens: :func:`meshtorch.runtime.generate.sample` (prefill: encoder + caches, then steps) and ``generate``
(``min_new_tokens`` = ``max_new_tokens``, so both decode ``--new`` tokens). Medians and 10th-90th percentiles; the
step's time at its last 5 tokens over tokens 3-7 (flat in position: the cache has a fixed size).

Usage (small, seconds): ``python benchmarks/t5_decode.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import _fmt  # noqa: E402
from host import describe  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--input", type=int, default=32, help="encoder input length")
    p.add_argument("--new", type=int, default=48, help="new tokens")
    p.add_argument("--repeats", type=int, default=5, help="whole greedy decodes of each")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers

    from meshtorch.checkpoint import hf
    from meshtorch.mesh.placement import PlacementMeshImpl
    from meshtorch.runtime.generate import CachedDecoder, sample

    cfg = transformers.T5Config(vocab_size=a.vocab, d_model=a.d_model, d_kv=a.d_model // a.heads, d_ff=a.d_ff,
                                num_layers=a.layers, num_heads=a.heads, feed_forward_proj="gated-gelu",
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                scale_decoder_outputs=False)
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # T5 v1.1's untied head (transformers v5 ties it whatever the config says)
        ref.lm_head.weight = torch.nn.Parameter(0.05 * torch.randn(a.vocab, a.d_model))
    ref.config.tie_word_embeddings = False
    path = tempfile.mkdtemp(prefix="t5_decode_bench_")
    ref.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["tie_word_embeddings"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    print(describe())
    print(f"T5 v1.1 shape: {a.layers}+{a.layers} layers, d_model {a.d_model}, {a.heads} heads, d_ff {a.d_ff}, vocab "
          f"{a.vocab}; batch 1; input {a.input}; {a.new} new tokens; {a.threads} thread(s)")
    L = max(a.input, a.new + 1)
    model, lw = hf.load(path, PlacementMeshImpl("", ""), batch_size=1, length=L)
    dec = CachedDecoder.of(lw, model)
    x = torch.randint(2, a.vocab, (1, a.input), generator=torch.Generator().manual_seed(1))
    enc = torch.zeros(1, L, dtype=torch.int64)
    enc[:, :a.input] = x
    ids = torch.randint(2, a.vocab, (1, a.new + 1), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 0
    dec.prefill(torch.zeros(1, L, dtype=torch.int64), enc)
    with torch.no_grad():
        enc_out = ref.get_encoder()(input_ids=x)
        pkv = ref(encoder_outputs=enc_out, decoder_input_ids=ids[:, :1], use_cache=True).past_key_values
    dec.step(ids[:, 0], 0)  # warm-up; the timed steps rewrite positions 1..
    ours, theirs = [], []
    for t in range(1, a.new):
        t0 = time.perf_counter()
        dec.step(ids[:, t], t)
        t1 = time.perf_counter()
        with torch.no_grad():
            pkv = ref(encoder_outputs=enc_out, decoder_input_ids=ids[:, t:t + 1], past_key_values=pkv,
                      use_cache=True).past_key_values
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    late = statistics.median(ours[-5:]) / statistics.median(ours[2:7])
    print(f"per token: kv cache {_fmt(ours)} | transformers past_key_values {_fmt(theirs)} | transformers/ours "
          f"{statistics.median(theirs) / statistics.median(ours):.2f} | last 5 / tokens 3-7 {late:.2f}")
    whole_ours, whole_theirs = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        sample(lw, model, [0], a.new, temperature=0.0, encoder_ids=x[0])
        t1 = time.perf_counter()
        with torch.no_grad():
            ref.generate(x, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, use_cache=True)
        t2 = time.perf_counter()
        whole_ours.append(t1 - t0)
        whole_theirs.append(t2 - t1)
    ratio = statistics.median(whole_theirs) / statistics.median(whole_ours)
    print(f"whole greedy decode of {a.new} tokens: meshtorch sample {_fmt(whole_ours)} | transformers generate "
          f"{_fmt(whole_theirs)} | transformers/ours {ratio:.2f}")


if __name__ == "__main__":
    main()
