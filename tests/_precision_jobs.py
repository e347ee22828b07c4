"""Worker of tests/test_precision_train.py (runs inside gloo ranks)."""

import torch

from meshtorch.runtime.train import main_train
from meshtorch.runtime.train_config import TrainConfig

FLAGS = dict(preset="tiny", layers=1, d_model=32, heads=4, d_kv=8, d_ff=64, length=16, batch_size=8, steps=3,
             eval_every=3, eval_batches=1, sample=0, plot="", lr=1e-2, warmup_steps=1, vocab_size=64)


def train(root: str, precision: str, mesh: str, layout: str, storage: str = ""):
    """``meshtorch train --precision`` in this rank, after the process's float32 matmul precision was set to
    'medium' (so whatever the run leaves was set by the run): losses, matmul precision, variable dtypes."""
    torch.set_float32_matmul_precision("medium")
    res = main_train(TrainConfig(**FLAGS, precision=precision, mesh=mesh, layout=layout, storage=storage,
                                 runs_dir=root, run_name=f"{precision}-{mesh.replace(':', '') or 'one'}"))
    lw = res["lowering"]
    return {"losses": res["history"]["loss"], "matmul": torch.get_float32_matmul_precision(),
            "dtypes": sorted({str(lw.variable_value(n).dtype) for n in lw.variable_names})}


def train_both(root: str):
    """:func:`train` under tf32 then bf16, data parallel with storage ``d_model:data`` on this job's ranks."""
    return {p: train(root, p, "data:2", "batch:data", "d_model:data") for p in ("tf32", "bf16")}
