"""``meshtorch sample --checkpoint-dir T5DIR``: a T5 (``T5ForConditionalGeneration``) directory reads the prompt
with its encoder and decodes the output with Mesh TF's in-graph decoding (``Bitransformer.decode``, built by
:func:`meshtorch.transformer.t5.build_hf_t5`): greedy (``--temperature 0``), temperature / top-k sampling, or
beam search (``--beam N``, no length penalty)."""

from __future__ import annotations

import torch

from meshtorch.checkpoint import hf, restore
from meshtorch.core.errors import UsageError
from meshtorch.mesh.factory import make_mesh_impl
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.transformer.t5 import build_hf_t5

__all__ = ["t5_sample"]

EOS = 1  # T5's eos_token_id; the decoded ids are 0 after it


def t5_sample(args, cfg: HFModelConfig, path: str, tok, prompt: list[int], ckpt: str | None = None) -> list[list[int]]:
    """Decode ``args.max_new_tokens`` ids for ``prompt`` (``tok``'s checked ids of ``--prompt``, the encoder's
    input) from the T5 directory ``path`` (or, given ``ckpt``, that checkpoint of a ``meshtorch train --init-from
    T5DIR`` run) on ``--mesh`` / ``--layout``; ``--num-samples`` rows (``--beam``: one,
    the best beam). Prints each row's text up to T5's EOS on the leader; returns the ids (EOS and after dropped).
    Mesh TF's in-graph decoding loop keeps its own keys and values (``"incremental"`` mode); ``--no-cache``
    changes nothing here.

    Raises:
        UsageError: ``--beam`` with ``--temperature`` > 0. LayoutError: a layout that cannot split a dim.
    """
    if args.beam > 1 and args.temperature:
        raise UsageError("--beam: T5's beam search is deterministic; give --temperature 0 with --beam.")
    impl = make_mesh_impl(args.mesh, args.layout, device=getattr(args, "device", None))
    axis = impl.tensor_dimension_to_mesh_axis("batch")
    split = 1 if axis is None else impl.shape[axis].size
    rows = 1 if args.beam > 1 else args.num_samples
    batch = -(-rows // split) * split
    model = build_hf_t5(cfg.with_shape(batch, len(prompt)), seed=args.seed, decode_length=args.max_new_tokens,
                        beam_size=max(args.beam, 1), alpha=0.0, temperature=args.temperature,
                        top_k=args.top_k or -1)
    if ckpt is None:
        lw = hf.lower_loaded(model, impl, path)
    else:
        lw = model.lowering(mesh_impl=impl)
        restore(lw, ckpt)
    ids = torch.tensor([[int(i) for i in prompt]] * batch, dtype=torch.int32)
    out = lw.run(model.decoded, feeds={model.inputs: ids}).to(torch.int64)[:rows].tolist()
    outs = [row[:row.index(EOS)] if EOS in row else row for row in out]
    if impl.is_leader():
        for row in outs:
            print(tok.decode(row))
            print("-" * 40)
    return outs
