"""Run inside the 4 gloo processes of tests/test_kv_cache_spmd.py: KV-cache greedy and beam decoding of every
Hugging Face family on SpmdMeshImpl (``batch:data``, heads / kv_heads split over ``model``, FSDP storage)."""

from __future__ import annotations


def worker(jobs, new_tokens):
    """``jobs``: ``(name, model directory, prompts, encoder ids or None, beam size, batch, length)`` each; per name
    its greedy tokens (and the best beam where the beam size is > 0)."""
    import meshtorch as mtf
    from meshtorch.checkpoint import hf
    from meshtorch.runtime.generate import beam_search, sample

    impl = mtf.SpmdMeshImpl("data:2;model:2", "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model",
                            storage="d_model:data")
    out = {}
    for name, path, prompts, encoder_ids, beams, batch, length in jobs:
        model, lw = hf.load(path, impl, batch_size=batch, length=length)
        if encoder_ids is None:
            greedy = [sample(lw, model, p, max_new_tokens=new_tokens, temperature=0.0)[0] for p in prompts]
            beam = beam_search(lw, model, prompts[0], beam_size=beams, max_new_tokens=new_tokens) if beams else None
        else:
            greedy = sample(lw, model, [0], max_new_tokens=new_tokens, temperature=0.0, num_samples=len(prompts),
                            eos_ids=[1], encoder_ids=encoder_ids)
            beam = (beam_search(lw, model, [0], beam_size=beams, max_new_tokens=new_tokens, eos_ids=[1],
                                encoder_ids=encoder_ids[0]) if beams else None)
        out[name] = {"greedy": greedy, "beam": beam}
    return out
