"""Is the loss rise of the wide LM a bug? meshtorch's LM vs the same model in plain PyTorch, same initial weights,
same AdamW, same learning rates and clipping, step by step (issue 33: 26 layers at d_model 1792 gave losses 5.83,
5.84, 14.96 at ``--lr 1e-4 --warmup-steps 1``).

The meshtorch side is what ``meshtorch train`` builds: ``--optimizer adamw`` with the ``--schedule`` learning rate
(:func:`meshtorch.runtime.optimizers.make_optimizer`) and ``--clip-norm`` global-norm clipping, one process
(``PlacementMeshImpl`` on the empty mesh), batches of the built-in corpus with the byte tokenizer (vocabulary 256).
The PyTorch side is :class:`meshtorch.testing.torch_lm.TorchLM` loaded with the lowering's initial values,
``torch.optim.AdamW`` (betas 0.9/0.999, eps 1e-8, the same weight decay, ``foreach=False``), its learning rate
set each step to ``meshtorch train``'s host-side schedule value (:func:`meshtorch.runtime.train.host_lr`) and
``torch.nn.utils.clip_grad_norm_``. Printed per step: both losses, their relative difference, the global gradient
norm before clipping (both) and the learning rate.

Memory: the lowering draws lazily (``init="lazy"``), so while PyTorch trains only meshtorch's weights exist beside
it (5 copies of the parameters), then PyTorch's are freed before meshtorch trains (4 copies). 2 layers at d_model
1792 (d_ff 7168, 77M parameters): about 1.6 GiB.

Usage::

    python benchmarks/wide_lm_parity.py --layers 2 --d-model 1792 --steps 5
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402

import meshtorch as mtf  # noqa: E402
from meshtorch.cli.train import add_train_subcommand  # noqa: E402
from meshtorch.data.text import ByteTokenizer, PackedDataset, load_documents  # noqa: E402
from meshtorch.models.transformer import build_lm, preset  # noqa: E402
from meshtorch.runtime.optimizers import make_optimizer  # noqa: E402
from meshtorch.runtime.train import grad_sum_of_squares, host_lr  # noqa: E402
from meshtorch.testing.torch_lm import TorchLM  # noqa: E402


def train_args(a):
    """``meshtorch train``'s parsed flags for this shape (what make_optimizer and host_lr read)."""
    p = argparse.ArgumentParser()
    add_train_subcommand(p.add_subparsers(dest="cmd"))
    return p.parse_args(["train", "--optimizer", "adamw", "--lr", str(a.lr), "--warmup-steps", str(a.warmup),
                         "--steps", str(a.steps), "--clip-norm", str(a.clip), "--weight-decay", str(a.weight_decay)])


def batches(config, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """The first ``steps`` training batches ``[batch, length + 1]`` of the built-in corpus, as ``meshtorch train``
    draws them with ``--seed seed``."""
    data = PackedDataset.from_documents(load_documents(None), ByteTokenizer(), config.length + 1)
    stream = data.stream(config.batch_size, seed)
    return [next(stream)[2] for _ in range(steps)]


def torch_steps(model: TorchLM, args, data, weight_decay: float) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) per step of plain PyTorch AdamW with ``meshtorch train``'s schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                            foreach=False)  # one parameter at a time: no whole-model temporaries
    out = []
    for step, batch in enumerate(data):
        opt.param_groups[0]["lr"] = host_lr(args, step)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm) if args.clip_norm else None
        opt.step()
        out.append((loss.item(), float("nan") if norm is None else norm.item()))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1792)
    p.add_argument("--d-kv", type=int, default=128)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    args = train_args(a)
    config = preset("tiny", num_layers=a.layers, d_model=a.d_model, num_heads=a.d_model // a.d_kv, d_kv=a.d_kv,
                    d_ff=4 * a.d_model, length=a.length, batch_size=a.batch_size, dropout=0.0,
                    vocab_size=ByteTokenizer().vocab_size)
    lm = build_lm(config, seed=0, optimizer=make_optimizer(args), clip_norm=a.clip or None)
    lowering = mtf.Lowering(lm.graph, {lm.mesh: mtf.PlacementMeshImpl("", "")}, init="lazy")
    n_params = sum(v.shape.size for v in lm.graph.trainable_variables)
    data = batches(config, a.steps)
    model = TorchLM(config)
    names = dict(model.named_parameters())
    model.load_state_dict({n.replace("/", "."): lowering.variable_value(n) for n in lowering.variable_names
                           if n.replace("/", ".") in names}, strict=True)
    ref = torch_steps(model, args, data, a.weight_decay)
    del model
    gc.collect()
    sumsq = grad_sum_of_squares(lm.graph)
    fetches = [lm.loss] + ([sumsq] if sumsq is not None else []) + lm.updates
    print(f"{a.layers} layers, d_model {a.d_model}, d_ff {4 * a.d_model}, {n_params / 1e6:.1f}M parameters; batch "
          f"{a.batch_size} x length {a.length}; AdamW lr {a.lr} (warm-up {a.warmup}, cosine over {a.steps}), "
          f"clip {a.clip}, weight decay {a.weight_decay}")
    print("step  lr        meshtorch loss  torch loss  rel diff  meshtorch |g|  torch |g|")
    worst = 0.0
    for step, batch in enumerate(data):
        outs = lowering.run(fetches, feeds={lm.inputs: batch[:, :-1], lm.targets: batch[:, 1:]})
        loss = outs[0].item()
        norm = math.sqrt(outs[1].item()) if sumsq is not None else float("nan")
        rel = abs(loss - ref[step][0]) / abs(ref[step][0])
        worst = max(worst, rel)
        print(f"{step:4d}  {host_lr(args, step):.2e}  {loss:14.6f}  {ref[step][0]:10.6f}  {rel:8.1e}  "
              f"{norm:13.4f}  {ref[step][1]:9.4f}")
    print(f"largest relative loss difference: {worst:.2e}")


if __name__ == "__main__":
    main()
