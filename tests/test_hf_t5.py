"""T5 v1.1 (``T5ForConditionalGeneration``: gated-gelu, untied head, shared relative attention bias) imported onto
the block builder (Mesh TF's T5 graph), against ``transformers``: logits under several layouts, bitwise export round
trip, AdamW fine-tuning, ``meshtorch sample`` (greedy and 4-beam, through the KV-cache decoder) on a peaked model.
Greedy tokens, step logits and beam search of the KV-cache decoder itself: ``tests/test_t5_kv_decode.py``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_fixtures as F  # noqa: E402
import meshtorch as mtf  # noqa: E402
from meshtorch.checkpoint import hf  # noqa: E402
from meshtorch.data.hf_tokenizer import HFTokenizer  # noqa: E402
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


def _peaked_t5(path, seed=3, q=4.0, head=4.0, cross=1.0, eos=True):
    """The T5 fixture with the q projections scaled by ``q``, lm_head by ``head`` (peaked attention and output
    distribution) and the encoder-decoder attention's output by ``cross`` (> 1: the decoded ids follow the
    encoder's input and its order), saved to ``path``. ``eos=False`` zeroes lm_head's EOS row (logit 0: no beam
    ends early, where Mesh TF's search, as tensor2tensor's, returns a finished hypothesis over any alive one and
    ``transformers`` ranks both by score)."""
    ref = F.make_t5(seed=seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            for part, k in (("q.weight", q), ("lm_head", head), ("EncDecAttention.o.weight", cross)):
                if part in name:
                    p.mul_(k)
        if not eos:
            ref.lm_head.weight[1] = 0.0
    return ref, F.save_t5(ref, str(path))


PROMPT = 40


def test_t5_sample_from_the_command_line_equals_generate(tmp_path, capsys):
    """``meshtorch sample --checkpoint-dir T5DIR``: the prompt is the encoder's input; greedy and 4-beam outputs
    equal ``generate`` (ids up to EOS); ``train --init-from T5DIR`` on plain text (not pairs) is refused in one line."""
    from meshtorch.cli import build_parser, main

    text = F.text()
    prompt, n = text[:PROMPT], 10
    kw = dict(max_new_tokens=n, do_sample=False, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    # 6 distinct greedy ids that reversing the prompt moves; for beam search no EOS (see _peaked_t5)
    for beam, mesh, layout, eos in ((0, "", "", True), (4, "model:2", "heads:model;d_ff:model;vocab:model", False)):
        ref, path = _peaked_t5(tmp_path / f"t5-{beam}", q=2.0, cross=4.0, eos=eos)
        F.bpe_tokenizer(f"{path}/tokenizer.json", text)
        x = torch.tensor([[int(i) for i in HFTokenizer(f"{path}/tokenizer.json").encode(prompt)]])
        with torch.no_grad():
            want = ref.generate(x, **kw, **({"num_beams": beam, "length_penalty": 0.0} if beam else {}))[0, 1:].tolist()
        want = want[:want.index(1)] if 1 in want else want
        argv = ["sample", "--checkpoint-dir", path, "--prompt", prompt, "--max-new-tokens", str(n), "--temperature",
                "0", "--beam", str(beam), "--mesh", mesh, "--layout", layout]
        args = build_parser().parse_args(argv)
        assert args.func(args) == [want], beam
        assert len(want) > 3 and len(set(want)) > 2, want  # not an immediate EOS nor one id repeated
    args = build_parser().parse_args(argv[:-8] + ["--temperature", "1.0", "--top-k", "3", "--num-samples", "2",
                                                   "--seed", "1"])
    rows = args.func(args)  # sampling (seeded): 2 rows of ids inside the vocabulary
    assert len(rows) == 2 and all(0 < i < ref.config.vocab_size for r in rows for i in r), rows
    data = tmp_path / "d.txt"
    data.write_text(text)
    capsys.readouterr()
    assert main(["train", "--init-from", path, "--data", str(data), "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert "a T5 pair is one line 'input<TAB>target'" in err and len(err.strip().splitlines()) == 1, err


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
