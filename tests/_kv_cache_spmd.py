"""Run inside the 4 gloo processes of tests/test_kv_cache_spmd.py: KV-cache greedy and beam decoding of a
Hugging Face Llama on SpmdMeshImpl (``batch:data``, heads / kv_heads split over ``model``, FSDP storage)."""

from __future__ import annotations


def worker(path, prompts, new_tokens, length):
    import meshtorch as mtf
    from meshtorch.checkpoint import hf
    from meshtorch.runtime.generate import beam_search, sample

    impl = mtf.SpmdMeshImpl("data:2;model:2", "batch:data;heads:model;kv_heads:model;d_ff:model;vocab:model",
                            storage="d_model:data")
    model, lw = hf.load(path, impl, batch_size=2, length=length)
    greedy = [sample(lw, model, p, max_new_tokens=new_tokens, temperature=0.0)[0] for p in prompts]
    beams = beam_search(lw, model, prompts[0], beam_size=2, max_new_tokens=new_tokens)
    return {"greedy": greedy, "beam": beams}
