"""T5 v1.1 (``T5ForConditionalGeneration``: gated-gelu, untied head, shared relative attention bias) imported into
``mtf.transformer.Bitransformer`` as Mesh TF built it, against ``transformers``: logits under several layouts,
bitwise export round trip, AdamW fine-tuning, greedy decoding with a decoder start token, beam search (4 beams) on a
peaked model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.testing import rel_error  # noqa: E402

B, L = 4, 8
LAYOUTS = [("", "", ""), ("data:4", "batch:data", ""),
           ("data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model", ""),
           ("data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model", "d_model:data")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = F.make_t5()
    return m, F.save_t5(m, str(tmp_path_factory.mktemp("t5") / "t5"))


def _impl(mesh, layout, storage):
    return mtf.PlacementMeshImpl(mesh, layout, storage=storage or None)


@pytest.mark.parametrize("mesh,layout,storage", LAYOUTS, ids=[f"{m}|{lay}|{s}" for m, lay, s in LAYOUTS])
def test_t5_logits_and_loss_match_transformers(saved, mesh, layout, storage):
    ref, path = saved
    x, y = F.t5_batch(B, L, seed=1), F.t5_batch(B, L, seed=2)
    with torch.no_grad():
        want = ref(input_ids=x, labels=y)
    model, lw = hf.load(path, _impl(mesh, layout, storage), batch_size=B, length=L)
    logits, loss = lw.run([model.logits, model.loss], feeds={model.inputs: x, model.targets: y})
    assert rel_error(logits, want.logits) <= 1e-5
    assert abs(loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()


def test_t5_export_round_trip_bitwise(saved, tmp_path):
    ref, path = saved
    model, lw = hf.load(path, _impl(*LAYOUTS[3]), batch_size=B, length=L)
    out = str(tmp_path / "out")
    assert hf.export(lw, model, out) == ["model.safetensors", "config.json"]
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    x, y = F.t5_batch(B, L, seed=3), F.t5_batch(B, L, seed=4)
    with torch.no_grad():
        assert torch.equal(back(input_ids=x, labels=y).logits, ref(input_ids=x, labels=y).logits)


def test_t5_adamw_finetuning_matches_torch(saved):
    ref, path = saved
    torch_model = F.make_t5().train()
    lr, wd = 3e-3, 0.01
    opt = torch.optim.AdamW(torch_model.parameters(), lr=lr, eps=1e-8, weight_decay=wd)
    model, lw = hf.load(path, _impl(*LAYOUTS[2]), batch_size=B, length=L,
                        optimizer=mtf.optim.AdamWOptimizer(learning_rate=lr, epsilon=1e-8, weight_decay=wd))
    ours, theirs = [], []
    for step in range(10):
        x, y = F.t5_batch(B, L, seed=10 + step % 2), F.t5_batch(B, L, seed=20 + step % 2)
        ours.append(lw.run([model.loss] + model.updates, feeds={model.inputs: x, model.targets: y})[0].item())
        loss = torch_model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    assert theirs[-1] < theirs[0]
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def test_t5_greedy_decoding_equals_generate(saved):
    ref, path = saved
    x = F.t5_batch(B, L, seed=5)
    n = 12
    with torch.no_grad():
        gen = ref.generate(x, max_new_tokens=n, do_sample=False, decoder_start_token_id=0, eos_token_id=1,
                           pad_token_id=0, attention_mask=torch.ones_like(x))[:, 1:]
    want = torch.zeros(B, n, dtype=torch.int64)
    want[:, : gen.shape[1]] = gen
    model, lw = hf.load(path, _impl("model:2", "heads:model;d_ff:model;vocab:model", ""), batch_size=B, length=L,
                        decode_length=n)
    got = lw.run(model.decoded, feeds={model.inputs: x})
    assert torch.equal(got.to(torch.int64), want), (got, want)


@pytest.mark.parametrize("mesh,layout", [("", ""), ("model:2", "heads:model;d_ff:model;vocab:model")])
def test_t5_beam_search_equals_generate_num_beams_4(tmp_path, mesh, layout):
    """Mesh TF's beam search (4 beams, no length penalty) on a model whose attention and output distribution are
    peaked (q and lm_head scaled by 4, so the beams' scores differ and a wrong weight map moves them) equals
    ``generate(num_beams=4, length_penalty=0)``. (On the unscaled model a row whose best hypothesis is an
    immediate EOS differs: Mesh TF finishes it at once, ``transformers`` keeps a longer one.)"""
    from meshtorch.transformer.t5 import build_hf_t5

    ref = F.make_t5(seed=3)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("q.weight") or name.startswith("lm_head"):
                p.mul_(4.0)
    path = F.save_t5(ref, str(tmp_path / "t5"))
    x, n = F.t5_batch(2, L, seed=5), 12
    with torch.no_grad():
        want = ref.generate(x, max_new_tokens=n, num_beams=4, do_sample=False, length_penalty=0.0,
                            decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
                            attention_mask=torch.ones_like(x))[:, 1:]
    model = build_hf_t5(hf.read_config(path).with_shape(2, L), decode_length=n, beam_size=4, alpha=0.0)
    lw = hf.lower_loaded(model, _impl(mesh, layout, ""), path)
    got = lw.run(model.decoded, feeds={model.inputs: x}).to(torch.int64)
    assert want.shape == got.shape and torch.equal(got, want), (got, want)


def test_t5_refusals(saved, tmp_path):
    import json
    import shutil

    _, path = saved
    for field, value in (("feed_forward_proj", "gated-silu"), ("tie_word_embeddings", True),
                         ("relative_attention_max_distance", 64), ("scale_decoder_outputs", True)):
        d = str(tmp_path / field)
        shutil.copytree(path, d)
        cfg = json.load(open(f"{d}/config.json"))
        cfg[field] = value
        json.dump(cfg, open(f"{d}/config.json", "w"))
        with pytest.raises(mtf.CheckpointError, match=f"field '{field}'"):
            hf.load(d, batch_size=1, length=4)
