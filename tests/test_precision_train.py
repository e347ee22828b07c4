"""``meshtorch train --precision fp32|tf32|bf16 --reduce-dtype``: the flag in every torchrun rank, run.json, the
same bf16 losses on gloo ranks as on one process, and the Hugging Face path (``--init-from``) in bf16."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshtorch.cli import main
from meshtorch.testing.spmd import run_spmd

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_ranks_set_matmul_precision_and_match_one_process_in_bf16(tmp_path):
    """2 gloo ranks (FSDP: storage d_model:data): each rank runs with its float32 matmul precision set by the
    flag ('high' under tf32, 'highest' otherwise, from 'medium' before the run), keeps float32 variables, and
    the bf16 losses equal the one-process run on the same mesh's layout (the same kernels on the same slices,
    gloo sums of 2 partials as the placement mesh sums them): measured identical; bound 1e-6 relative."""
    import _precision_jobs as J

    root = str(tmp_path)
    res = run_spmd("_precision_jobs:train_both", args=(root,), nprocs=2, timeout_s=300, extra_path=[TESTS]).check()
    ranks = {p: [r[p] for r in res.results] for p in ("tf32", "bf16")}
    assert [r["matmul"] for r in ranks["tf32"]] == ["high", "high"]
    assert [r["matmul"] for r in ranks["bf16"]] == ["highest", "highest"]
    for r in ranks["bf16"]:
        assert r["dtypes"] == ["torch.float32", "torch.int64"]
    with open(os.path.join(root, "tf32-data2", "ckpt", "run.json")) as f:
        rec = json.load(f)["precision"]
    assert rec == {"precision": "tf32", "compute_dtype": "float32", "reduce_dtype": "float32",
                   "float32_matmul_precision": "high"}
    old = torch.get_float32_matmul_precision()
    try:
        one = J.train(os.path.join(root, "one"), "bf16", "data:2", "batch:data", "d_model:data")
    finally:
        torch.set_float32_matmul_precision(old)
    for r in ranks["bf16"]:
        assert max(abs(a - b) / b for a, b in zip(r["losses"], one["losses"], strict=True)) <= 1e-6


def test_precision_flag_errors(tmp_path, capsys):
    rc = main(["train", "--precision", "fp32", "--reduce-dtype", "bfloat16", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--reduce-dtype bfloat16 needs --precision bf16" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["train", "--precision", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
def test_init_from_bf16_first_loss_matches_transformers_in_bf16(tmp_path, family):
    """``--init-from DIR --precision bf16`` (GPT-2 with a padded vocabulary on vocab:model, Llama with rotary
    and grouped-query attention and its own tokenizer.json): float32 masters read from the safetensors, and the
    first loss equals transformers' on the same batch with the model cast to bfloat16 (loss from float32
    logits), closer than to transformers' float32 loss. Measured relative differences: GPT-2 1.5e-5 (4.1e-5
    to float32), Llama 2.5e-6 (1.4e-5 to float32); bound 1e-4 (a twentieth of a bf16 rounding, 2**-9: the
    loss is a float32 mean over 64 positions whose roundings partly cancel)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import _hf_fixtures as F
    from meshtorch.cli import build_parser
    from meshtorch.data.hf_tokenizer import HFTokenizer
    from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents

    ref = F.make_model(family, vocab=257) if family == "gpt2" else F.make_model(family)
    src = F.save(ref, str(tmp_path / family))
    data = tmp_path / "data.txt"
    data.write_text(F.text())
    flags = ["--tokenizer", "byte"] if family == "gpt2" else []
    if family != "gpt2":
        F.bpe_tokenizer(os.path.join(src, "tokenizer.json"), F.text())
    args = build_parser().parse_args(["train", "--init-from", src, *flags, "--data", str(data),
                                      "--runs-dir", str(tmp_path / "runs"), "--precision", "bf16", "--steps", "1",
                                      "--batch-size", "4", "--length", "16", "--eval-every", "1", "--eval-batches",
                                      "1", "--plot", "", "--sample", "0"])
    res = args.func(args)
    lw = res["lowering"]
    assert {lw.variable_value(n).dtype for n in lw.variable_names} <= {torch.float32, torch.int64}
    tok = ByteTokenizer() if family == "gpt2" else HFTokenizer(os.path.join(src, "tokenizer.json"))
    batch = next(PackedDataset.from_documents(load_documents([str(data)]), tok, 17).batches(4, seed=0))

    def loss(model):
        with torch.no_grad():
            logits = model(batch[:, :-1]).logits.float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     batch[:, 1:].reshape(-1)).item()

    want32 = loss(ref)
    want = loss(ref.to(torch.bfloat16))
    got = res["history"]["loss"][0]
    assert abs(got - want) <= 1e-4 * want
    assert abs(got - want) < abs(got - want32)
