"""Milliseconds per new token: meshtorch's KV-cache decoder, its full-graph recompute path and ``transformers``'
cached decoding, on the same GPT-2-shaped model (random weights, float32, batch 1), interleaved per token.

For each prompt length P the graph's context is ``P + new`` positions; per new token, in turn: one meshtorch
cache step (:class:`meshtorch.runtime.generate.CachedDecoder`), one ``GPT2LMHeadModel`` forward of one token with
its ``past_key_values`` (what ``generate(use_cache=True)`` runs per token), and, every ``--recompute-every``-th
token, one full-graph run (the ``use_cache=False`` path). Medians and the 10th-90th percentile spread are
printed, and the cache step's time at token 20 vs its last token (medians of 5 tokens each; and of the last 20 vs
tokens 10-29, steadier on a shared host): flat in position, as the cache has a fixed size.

Usage (small, seconds): ``python benchmarks/decode.py``; the 124M shape (the lead's machine):
``python benchmarks/decode.py --layers 12 --d-model 768 --heads 12 --vocab 50257 --prompts 32 --new 200``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import describe  # noqa: E402


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _fmt(xs) -> str:
    return f"{statistics.median(xs) * 1e3:8.2f} ms ({_pct(xs, .1) * 1e3:.2f}-{_pct(xs, .9) * 1e3:.2f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", default="8,64", help="prompt lengths, comma separated")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--recompute-every", type=int, default=4, help="time the recompute path every k-th token")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="the meshtorch programs through torch.compile")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers

    from meshtorch.checkpoint import hf
    from meshtorch.mesh.placement import PlacementMeshImpl
    from meshtorch.runtime.generate import CachedDecoder, _next_logits

    prompts = [int(x) for x in a.prompts.split(",")]
    positions = max(prompts) + a.new
    cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=a.d_model, n_head=a.heads, vocab_size=a.vocab,
                                  n_positions=positions)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).float().eval()
    path = tempfile.mkdtemp(prefix="decode_bench_")
    ref.save_pretrained(path, safe_serialization=True)
    print(describe())
    print(f"GPT-2 shape: {a.layers} layers, d_model {a.d_model}, {a.heads} heads, vocab {a.vocab}; batch 1; "
          f"{a.threads} thread(s); {a.new} new tokens; compile={a.compile}")
    for P in prompts:
        L = P + a.new
        model, lw = hf.load(path, PlacementMeshImpl("", ""), batch_size=1, length=L)
        dec = CachedDecoder.of(lw, model)
        if a.compile:  # the decoder's programs through torch.compile (the recompute path stays codegen)
            dec.lowering = dec.graph.lowering(dec.impl, mode="compile")
            dec.load(lw)
        ids = torch.randint(0, a.vocab, (1, L), generator=torch.Generator().manual_seed(P))
        buf = torch.zeros(1, L, dtype=torch.int64)
        buf[:, :P] = ids[:, :P]
        dec.prefill(buf)
        dec.step(ids[:, P], P)  # warm-up (compiles with --compile); the first timed step rewrites position P
        _next_logits(lw, model, buf, P)
        with torch.no_grad():
            out = ref(ids[:, :P], use_cache=True)
        pkv = out.past_key_values
        ours, theirs, full = [], [], []
        for i, t in enumerate(range(P, L)):
            t0 = time.perf_counter()
            dec.step(ids[:, t], t)
            t1 = time.perf_counter()
            with torch.no_grad():
                pkv = ref(ids[:, t: t + 1], past_key_values=pkv, use_cache=True).past_key_values
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
            if i % a.recompute_every == 0:
                buf[:, : t + 1] = ids[:, : t + 1]
                t3 = time.perf_counter()
                _next_logits(lw, model, buf, t + 1)
                full.append(time.perf_counter() - t3)
        late = statistics.median(ours[-5:]) / statistics.median(ours[18:23]) if len(ours) >= 28 else float("nan")
        # the same over wider windows (last 20 tokens / tokens 10-29): less sensitive to a shared host's load
        wide = statistics.median(ours[-20:]) / statistics.median(ours[10:30]) if len(ours) >= 50 else float("nan")
        print(f"prompt {P:4d} (context {L}): kv cache {_fmt(ours)} | recompute {_fmt(full)} | "
              f"transformers use_cache {_fmt(theirs)} | transformers/ours "
              f"{statistics.median(theirs) / statistics.median(ours):.2f} | last/20th token {late:.2f} "
              f"(last 20 / tokens 10-29: {wide:.2f})")


if __name__ == "__main__":
    main()
