"""Hugging Face import / export (GPT-2, Llama with GQA and with a tied head, T5 v1.1, Qwen2, Mistral) on 4 gloo ranks
(SpmdMeshImpl, FSDP storage ``d_model:data`` with ``heads``/``kv_heads``/``d_ff``/``vocab`` split): each rank reads
exactly its slices, logits match ``transformers``, and the export written from the 4-rank run loads with
``from_pretrained``."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402
from meshtorch.testing.spmd import run_spmd  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


FAMILIES = ("llama_gqa", "llama_tied", "gpt2", "t5", "qwen2", "mistral")


def test_hf_on_four_gloo_ranks(tmp_path):
    """One 4-process job imports and exports every family."""
    refs = {f: F.make_t5() if f == "t5" else F.make_model(f) for f in FAMILIES}
    jobs = [((F.save_t5 if f == "t5" else F.save)(refs[f], str(tmp_path / f / "in")), str(tmp_path / f / "out"))
            for f in FAMILIES]
    ids = F.t5_batch(4, 16)  # no 0 (T5's padding) and no 1 (its EOS)
    run = run_spmd("_hf_spmd:worker", args=(jobs, ids), nprocs=4, timeout_s=240, extra_path=[TESTS_DIR]).check()
    for fam, (_, out_dir), *per_rank in zip(FAMILIES, jobs, *run.results, strict=True):
        with torch.no_grad():
            want = (refs[fam](input_ids=ids, labels=ids) if fam == "t5" else refs[fam](ids)).logits
        for rank, r in enumerate(per_rank):
            assert rel_error(r["logits"], want) <= 1e-5, (fam, rank)
            # each rank read exactly the elements of the slices it holds, a fraction of the model
            assert r["read"] == r["held"], (fam, rank, r["read"], r["held"])
            assert r["held"] < 0.5 * r["total"], (fam, rank, r["held"], r["total"])
        assert per_rank[0]["written"] == ["model.safetensors", "config.json"]
        assert all(r["written"] == [] for r in per_rank[1:])
        auto = transformers.AutoModelForSeq2SeqLM if fam == "t5" else transformers.AutoModelForCausalLM
        back = auto.from_pretrained(out_dir).eval()
        with torch.no_grad():
            got = back(input_ids=ids, labels=ids) if fam == "t5" else back(ids)
            assert torch.equal(got.logits, want), fam
