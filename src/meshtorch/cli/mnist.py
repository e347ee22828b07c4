"""``meshtorch mnist``: the argument parser (the job: :mod:`meshtorch.runtime.mnist`)."""

from __future__ import annotations

from meshtorch.data.mnist import DEFAULT_DATA_DIR
from meshtorch.runtime.mnist import MODEL_DEFAULTS, main_mnist


def add_parser(subparsers):
    """Register ``meshtorch mnist`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "mnist", help="train Mesh TF's README MNIST model on (Fashion-)MNIST",
        description="Train Mesh TensorFlow's README MNIST model (one hidden ReLU layer, SGD) on a simulated "
                    "processor mesh, or as one process per processor under "
                    "`torchrun --nproc-per-node N -m meshtorch mnist` or `meshtorch launch -n N -- mnist` "
                    "(each process feeds only its batch slice; rank 0 prints). "
                    "The layout changes where computation and communication happen, never the numbers.")
    p.add_argument("--model", default="mlp", choices=sorted(MODEL_DEFAULTS),
                   help="mlp: Mesh TF's README model; conv: Mesh TF's examples/mnist.py (spatially partitioned "
                        "convolutions) (default: %(default)s)")
    p.add_argument("--mesh", default=None, help='mesh shape, e.g. "rows:2;cols:2", "all:4", or "" for one processor '
                   "(default: mlp rows:2;cols:2, conv b1:2;b2:2)")
    p.add_argument("--layout", default=None, help="layout rules tensor_dim:mesh_axis (default: mlp "
                   "batch:rows;hidden:cols, conv row_blocks:b1;col_blocks:b2)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the training set (default: mlp 3, conv 2)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step (default: mlp 100, conv 200)")
    p.add_argument("--hidden", type=int, default=None, help="size of the hidden dims (default: mlp 1024, conv 512)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: mlp 0.1 SGD, conv 0.01 momentum "
                   "after a 100-step warmup)")
    p.add_argument("--activation", default="relu", choices=["relu", "gelu"],
                   help="conv model: activation after the convolutions and hidden layers (default: %(default)s, as "
                        "Mesh TF; with gelu, float32 runs under different layouts stay equal to ~1e-6)")
    p.add_argument("--seed", type=int, default=0, help="seed of initial weights and shuffling (default: %(default)s)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="directory of the IDX files (default: %(default)s)")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="cap on steps per epoch (default: all)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: torch's default, one per core); 1 is much faster on "
                        "a CPU shared with other busy processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-eval", action="store_true", help="skip the test-set evaluation after each epoch")
    p.add_argument("--activation-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype; weights stay float32 (mtf.VariableDType) (default: %(default)s)")
    p.add_argument("--trace-collectives", action="store_true",
                   help="after training, print the time per collective kind and mesh axis and the slowest "
                        "collectives this process executed (the flight recorder; rank 0's under torchrun)")
    p.set_defaults(func=main_mnist)
    return p
