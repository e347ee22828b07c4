"""``meshtorch plan``: the argument parser (its flags are read in :mod:`meshtorch.runtime.plan_command`; the
plan is :mod:`meshtorch.runtime.plan_lm`'s)."""

from __future__ import annotations

from meshtorch.cli._help import HelpFormatter
from meshtorch.core.schedules import SCHEDULES
from meshtorch.models.transformer import PRESETS, REMAT_POLICIES
from meshtorch.ops.precision import PRECISIONS, REDUCE_DTYPES
from meshtorch.runtime.calibrate import run_plan
from meshtorch.runtime.plan_lm import DEFAULT_LAYOUT, DEFAULT_MESH


def add_plan_subcommand(subparsers) -> None:
    """Register ``meshtorch plan`` on an argparse sub-parsers object."""
    p = subparsers.add_parser("plan", help="memory, FLOPs and communication of an LM step, before running; "
                                           "--search ranks layouts",
                              formatter_class=HelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model size preset")
    for flag in ("layers", "d-model", "heads", "d-kv", "d-ff", "length", "batch-size", "vocab", "experts"):
        p.add_argument(f"--{flag}", type=int, default=None, help="override the preset (default: the preset's)")
    p.add_argument("--mesh", default=DEFAULT_MESH, help='mesh shape, e.g. "data:2,model:2"; "" = 1 processor')
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help="layout rules tensor_dim:mesh_axis;...")
    p.add_argument("--storage", default="", help='storage layout rules for variables, e.g. "d_model:data" (FSDP)')
    p.add_argument("--pipeline-stages", type=int, default=None,
                   help="pipeline stages S (default: the size of the mesh axis of the layout's stage:<axis> rule; "
                        "--layers must be S x --pipeline-repeats; docs/pipeline.md)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches M (default: the stages, as meshtorch train); with --search: the "
                        "pipelined candidates' M, else the largest divisor of the batch up to 4x the stages")
    p.add_argument("--pipeline-repeats", type=int, default=None,
                   help="circular pipeline repeats R (layers = stages x R; default: layers / stages)")
    p.add_argument("--schedule", action="store_true",
                   help="with a pipelined --layout: print the schedule table (iteration x stage -> microbatch; with "
                        "--pipeline-schedule: that schedule's step x rank -> action)")
    p.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="plan this pipeline schedule's order of forward/backward actions: its bubble and peak "
                        "in-flight microbatches per stage (docs/pipeline.md)")
    p.add_argument("--search", action="store_true",
                   help="rank all layouts of --mesh (and place --layout among them) instead of reporting --layout")
    p.add_argument("--top", type=int, default=10, help="layouts to print with --search")
    p.add_argument("--memory-limit", default=None, help="bytes per processor (e.g. 16GiB): with --search, drop "
                   "layouts needing more; over it, pick the fastest --remat policy and storage rules that fit")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "adafactor", "sgd", "momentum"],
                   help="the optimizer whose state to plan, as meshtorch train --optimizer (adafactor: factored second "
                        "moments, no first moment)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="gradient accumulation as meshtorch train --accumulate N: plan one microbatch of "
                        "--batch-size / N (its activations) plus the float32 gradient accumulators")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="price the step as meshtorch train --precision runs it: bf16 activations, weight gathers "
                        "and bf16 gradient reductions at 2 bytes per element, masters and optimizer state at 4")
    p.add_argument("--reduce-dtype", default="float32", choices=list(REDUCE_DTYPES),
                   help="gradient reduction dtype under --precision bf16 (default: %(default)s)")
    p.add_argument("--remat", default="none", choices=list(REMAT_POLICIES),
                   help="activation checkpointing to plan (meshtorch train --remat); --memory-limit may pick another")
    p.add_argument("--hardware", default="auto", choices=["auto", "calibrated", "gpu", "cpu"],
                   help="cost model: calibrated = measured on this machine for --backend and --threads (measured "
                        "once, tens of seconds, then cached); auto = the calibration if one is cached, else the "
                        "fixed constants of this machine's kind; gpu = CostModel() (1e14 FLOP/s, 1e11 B/s, 1e-5 s); "
                        "cpu = CostModel.cpu() (1e11, 1e10, 5e-5)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine now (GEMM rate, kernel-call overhead, collectives of --backend), "
                        "replace the cached calibration, print what was measured, and plan with it")
    p.add_argument("--backend", default="placement", choices=["placement", "gloo", "nccl"],
                   help="what the plan's times and memory model: placement = one process simulating the mesh "
                        "(meshtorch train without torchrun), gloo / nccl = one process per processor (the report "
                        "of one --layout plans its schedule: 25 MiB gradient buckets, a 1 MiB first)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process the times model (meshtorch train's --threads default: 1)")
    p.add_argument("--flop-rate", type=float, default=None, help="cost model: FLOP/s per processor")
    p.add_argument("--bandwidth", type=float, default=None, help="cost model: link bytes/s")
    p.add_argument("--latency", type=float, default=None, help="cost model: seconds per collective")
    p.set_defaults(func=run_plan)


add_parser = add_plan_subcommand  # the cli's module protocol
