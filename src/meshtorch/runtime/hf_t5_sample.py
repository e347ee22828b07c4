"""``meshtorch sample --checkpoint-dir T5DIR``: a T5 (``T5ForConditionalGeneration``) directory reads the prompt
with its encoder and decodes the output through the block builder's KV-cache decoder
(:func:`meshtorch.models.hf_t5_decoder.build_t5_decoder`, the loop of :mod:`meshtorch.runtime.generate` that GPT-2
and Llama decode with): greedy (``--temperature 0``), temperature / top-k sampling (``--seed``), or beam search
(``--beam N``: ``transformers``' beam search, stopping at EOS, length penalty 1.0,
:func:`meshtorch.runtime.generate.beam_search`)."""

from __future__ import annotations

from meshtorch.checkpoint import hf, restore
from meshtorch.core.errors import UsageError
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.runtime.generate import beam_search, sample

__all__ = ["t5_sample"]


def t5_sample(args, cfg: HFModelConfig, path: str, tok, prompt: list[int], ckpt: str | None = None) -> list[list[int]]:
    """Decode ``args.max_new_tokens`` ids for ``prompt`` (``tok``'s checked ids of ``--prompt``, the encoder's
    input) from the T5 directory ``path`` (or, given ``ckpt``, that checkpoint of a ``meshtorch train --init-from
    T5DIR`` run) on ``--mesh`` / ``--layout``; ``--num-samples`` rows (``--beam``: one, the best beam). The encoder
    runs once; the decoder advances one position per token over its KV caches. Prints each row's text up to T5's EOS
    (``config.json``'s ``eos_token_id``) on the leader; returns the ids (EOS and after dropped).

    Raises:
        UsageError: ``--beam`` with ``--temperature`` > 0; ``--no-cache`` (T5 decodes with the cache only).
        LayoutError: a layout that cannot split a dim.
    """
    if args.beam > 1 and args.temperature:
        raise UsageError("--beam: T5's beam search is deterministic; give --temperature 0 with --beam.")
    if getattr(args, "no_cache", False):
        raise UsageError("--no-cache: T5 decodes with the KV cache only (the encoder once, one decoder position per "
                         "token); drop --no-cache.")
    impl = make_mesh_impl(args.mesh, args.layout, device=getattr(args, "device", None))
    axis = impl.tensor_dimension_to_mesh_axis("batch")
    split = 1 if axis is None else impl.shape[axis].size
    rows = 1 if args.beam > 1 else args.num_samples
    batch = -(-max(rows, args.beam) // split) * split
    start = [int(cfg.hf_config.get("decoder_start_token_id") or 0)]  # T5: the pad id 0
    length = max(len(prompt), len(start) + args.max_new_tokens)  # the encoder's input and the decoder's window
    if ckpt is None:
        lm, lw = hf.load(path, impl, batch_size=batch, length=length)
    else:
        lm = hf.build(cfg.with_shape(batch, length))
        lw = lm.lowering(mesh_impl=impl)
        restore(lw, ckpt)
    if args.beam > 1:
        out = [beam_search(lw, lm, start, beam_size=args.beam, max_new_tokens=args.max_new_tokens,
                           eos_ids=cfg.eos_ids, encoder_ids=prompt)]
    else:
        out = sample(lw, lm, start, args.max_new_tokens, args.temperature, args.top_k, args.seed, rows,
                     eos_ids=cfg.eos_ids, encoder_ids=prompt)
    eos = set(cfg.eos_ids)
    outs = [row[:min([i for i, t in enumerate(row) if t in eos], default=len(row))] for row in out]
    if impl.is_leader():
        for row in outs:
            print(tok.decode(row))
            print("-" * 40)
    return outs
