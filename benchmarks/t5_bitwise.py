"""Before/after check of a change to the T5 graphs: loss, logits and every variable's gradient, bitwise, under
1 processor and the 2x2 Megatron layout (with storage ``d_model:data``), of

* ``hf.build`` of tiny random ``T5ForConditionalGeneration`` directories (``save_pretrained`` under a fixed seed;
  gated-gelu and relu; batches with and without padding);
* :func:`meshtorch.models.encdec.build_encdec` (relative bias and absolute positions; dropout 0 and 0.1 with
  ``train=True``: the dropout masks too), from its seeded initial values.

    PYTHONPATH=src python benchmarks/t5_bitwise.py save /tmp/before.pt      # on the old code
    PYTHONPATH=src python benchmarks/t5_bitwise.py compare /tmp/before.pt   # on the new code: exit 1 on a difference
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import transformers

import meshtorch as mtf
from meshtorch.autodiff import gradients
from meshtorch.checkpoint import hf
from meshtorch.models.encdec import EncDecConfig, build_encdec

LAYOUTS = {"1proc": ("", "", None),
           "2x2": ("data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model", "d_model:data")}
B, L, V = 4, 8, 50


def _model(ff: str, tmp: str) -> str:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, feed_forward_proj=ff, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    m = transformers.T5ForConditionalGeneration(cfg).float()
    with torch.no_grad():  # transformers v5 ignores tie_word_embeddings=False here: untie the head by hand
        m.lm_head.weight = torch.nn.Parameter(torch.randn(V, 32))
        for p in m.parameters():  # weights of the size that makes attention far from uniform
            p.add_(0.3 * torch.randn(p.shape))
    path = os.path.join(tmp, ff)
    m.save_pretrained(path, safe_serialization=True)
    cfile = os.path.join(path, "config.json")
    with open(cfile) as f:
        c = json.load(f)
    c["tie_word_embeddings"] = False
    with open(cfile, "w") as f:
        json.dump(c, f)
    return path


def _batch(seed: int, pad: bool) -> torch.Tensor:
    x = torch.randint(2, V, (B, L), generator=torch.Generator().manual_seed(seed))
    if pad:
        x[1, 5:] = 0
        x[3, 2:] = 0
    return x


def results() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ff in ("gated-gelu", "relu"):
            path = _model(ff, tmp)
            cfg = hf.read_config(path).with_shape(B, L)
            for lname, (mesh, layout, storage) in LAYOUTS.items():
                model = hf.build(cfg)
                variables = model.graph.trainable_variables
                grads = gradients([model.loss], variables)
                lw = hf.lower_loaded(model, mtf.PlacementMeshImpl(mesh, layout, storage=storage), path)
                for pad in (False, True):
                    x, y = _batch(1, pad), _batch(2, pad)
                    got = lw.run([model.loss, model.logits] + grads, feeds={model.inputs: x, model.targets: y})
                    key = f"{ff}/{lname}/pad={pad}"
                    out[f"{key}/loss"], out[f"{key}/logits"] = got[0], got[1]
                    for v, g in zip(variables, got[2:], strict=True):
                        out[f"{key}/grad/{v.name}"] = g
        out.update(_encdec())
    return out


def _encdec() -> dict:
    out = {}
    base = dict(vocab_size=30, vocab_multiple=4, d_model=16, num_heads=4, d_kv=4, d_ff=16, num_encoder_layers=2,
                num_decoder_layers=2, input_length=8, target_length=6, batch_size=4, num_buckets=8, max_distance=16)
    x = torch.randint(1, 30, (4, 8), generator=torch.Generator().manual_seed(5))
    y = torch.randint(1, 30, (4, 6), generator=torch.Generator().manual_seed(6))
    x[2, 3:], y[1, 4:] = 0, 0
    for rel in (True, False):
        for rate in (0.0, 0.1):
            c = EncDecConfig(**base, relative_attention=rel, dropout=rate)
            for lname, (mesh, layout, storage) in LAYOUTS.items():
                m = build_encdec(c, seed=1, train=True)
                variables = m.graph.trainable_variables
                grads = gradients([m.loss], variables)
                lw = m.lowering(mesh_impl=mtf.PlacementMeshImpl(mesh, layout, storage=storage))
                got = lw.run([m.loss, m.logits] + grads, feeds={m.inputs: x, m.targets: y})
                key = f"encdec/rel={rel}/dropout={rate}/{lname}"
                out[f"{key}/loss"], out[f"{key}/logits"] = got[0], got[1]
                for v, g in zip(variables, got[2:], strict=True):
                    out[f"{key}/grad/{v.name}"] = g
                    out[f"{key}/init/{v.name}"] = lw.variable_value(v.name)
    return out


def main(argv) -> int:
    what, file = argv
    got = results()
    if what == "save":
        torch.save(got, file)
        print(f"saved {len(got)} tensors to {file}")
        return 0
    want = torch.load(file)
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    extra = sorted(set(got) - set(want))
    for k in bad[:20]:
        diff = (got[k] - want[k]).abs().max().item() if k in got and got[k].shape == want[k].shape else "missing"
        print(f"DIFFERS {k}: max abs diff {diff}")
    print(f"{len(want) - len(bad)}/{len(want)} tensors bitwise equal; {len(extra)} new keys {extra[:5]}")
    return 1 if bad or extra else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
