"""`meshtorch train` / `sample` end to end: checkpoint, exact resume, decoding identical across layouts."""

import argparse

import torch

from meshtorch.cli.sample import add_sample_subcommand
from meshtorch.cli.train import add_train_subcommand
from meshtorch.runtime.generate import beam_search, sample
from meshtorch.runtime.sample import load_lm

SMALL = ["--preset", "tiny", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64",
         "--length", "16", "--batch-size", "8", "--eval-batches", "1", "--sample", "0", "--plot", "",
         "--checkpoint-dir", "", "--dropout", "0.1", "--lr", "3e-3", "--warmup-steps", "2"]


def _args(*argv):
    p = argparse.ArgumentParser()
    sp = p.add_subparsers(dest="cmd")
    add_train_subcommand(sp)
    add_sample_subcommand(sp)
    return p.parse_args(list(argv))


def test_resume_is_bitwise_identical_and_decoding_is_layout_independent(tmp_path, capsys):
    full = _args("train", *SMALL, "--steps", "6", "--eval-every", "3", "--checkpoint-dir", str(tmp_path / "a"))
    ref = full.func(full)["history"]["loss"]
    first = _args("train", *SMALL, "--steps", "3", "--eval-every", "3", "--checkpoint-dir", str(tmp_path / "b"))
    first.func(first)
    resumed = _args("train", *SMALL, "--steps", "6", "--eval-every", "3", "--checkpoint-dir", str(tmp_path / "b"),
                    "--resume")
    out = resumed.func(resumed)
    assert "resumed from" in capsys.readouterr().out
    # bitwise: same floats; the first 3 come from the checkpoint's saved history (the plot continues the curve)
    assert out["history"]["loss"] == ref
    assert out["history"]["step"] == list(range(6))
    assert (tmp_path / "b" / "ckpt-6").is_dir()

    # decode from the checkpoint on three meshes: same tokens
    outs = []
    for mesh, layout in [("", ""), ("all:4", "batch:all"), ("all:4", "heads:all;d_ff:all;vocab:all"),
                         ("data:2,model:2", "batch:data;heads:model;d_ff:model;vocab:model")]:
        lm, lw = load_lm(str(tmp_path / "a"), mesh, layout)
        prompt = torch.tensor([84, 104, 101, 32])
        outs.append((sample(lw, lm, prompt, 8, temperature=0),
                     sample(lw, lm, prompt, 8, temperature=1.0, top_k=20, seed=3, num_samples=2),
                     beam_search(lw, lm, prompt, beam_size=3, max_new_tokens=6)))
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert len(outs[0][0][0]) == 8 and len(outs[0][2]) == 6

    s = _args("sample", "--checkpoint-dir", str(tmp_path / "a"), "--max-new-tokens", "5", "--temperature", "0")
    assert len(s.func(s)[0]) == 5


def test_storage_rules_change_where_weights_live_not_the_losses(capsys):
    from meshtorch.cli import main
    base = ["train", *SMALL, "--dropout", "0", "--steps", "3", "--eval-every", "3"]
    ref = _args(*base)
    ref_loss = ref.func(ref)["history"]["loss"]
    fsdp = _args(*base, "--storage", "d_model:data")
    out = fsdp.func(fsdp)
    assert torch.allclose(torch.tensor(out["history"]["loss"]), torch.tensor(ref_loss), rtol=1e-5)
    lw = out["lowering"]
    assert "reduce_scatter" in lw.counters.summary() or "reducescatter" in lw.counters.summary().replace("-", "")
    capsys.readouterr()
    assert main(["plan", "--preset", "tiny", "--layers", "1", "--length", "16", "--batch-size", "4", "--vocab", "64",
                 "--storage", "d_model:data"]) == 0
    planned = capsys.readouterr().out
    assert "allgather" in planned.replace("_", "").replace("-", "").replace(" ", "")


def test_every_flag_has_help_and_states_its_default_once():
    from meshtorch.cli import build_parser
    from meshtorch.cli._help import HelpFormatter

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "train" in a.choices)
    for name, p in sub.choices.items():
        fmt = HelpFormatter(name)
        for a in p._actions:
            if not a.option_strings or a.dest == "help":
                continue
            assert a.help, (name, a.option_strings)
            text = fmt._get_help_string(a) if isinstance(p.formatter_class, type) and issubclass(
                p.formatter_class, HelpFormatter) else a.help
            assert (text % {"default": a.default}).count("(default") <= 1, (name, a.option_strings, text)  # once
