"""``meshtorch train``: the argument parser (the training loop: :mod:`meshtorch.runtime.train`)."""

from __future__ import annotations

import argparse

from meshtorch.cli._help import HelpFormatter
from meshtorch.core.schedules import SCHEDULES
from meshtorch.models.transformer import PRESETS, REMAT_POLICIES
from meshtorch.ops.precision import PRECISIONS, REDUCE_DTYPES
from meshtorch.runtime.train import main_train
from meshtorch.runtime.train_config import (
    DATA_PARALLEL_LAYOUT,
    DEFAULT_LAYOUT,
    DEFAULT_MESH,
    DEFAULT_PRESET,
    DEFAULT_VOCAB_SIZE,
)

_OVERRIDES = (("layers", int, "Transformer blocks"), ("d-model", int, "model width"),
              ("heads", int, "attention heads"), ("d-kv", int, "size of each head"),
              ("d-ff", int, "feed-forward hidden size"), ("length", int, "context length in tokens"),
              ("batch-size", int, "sequences per step"), ("dropout", float, "dropout rate in [0, 1)"),
              ("experts", int, "mixture-of-experts experts per MoE layer (0: dense)"))


def _resume_mode(value: str) -> str:
    """``--resume``'s optional value: only ``auto``."""
    if value != "auto":
        raise argparse.ArgumentTypeError(f"{value!r}: the only value --resume takes is 'auto' (or none)")
    return value


def _start_step(value: str) -> int:
    """``--start-step``'s value: a whole number of steps, 0 or more."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give the step the exported run had reached, a whole number "
                                         ">= 0 (meshtorch export prints it)")
    return n


def add_train_subcommand(subparsers) -> None:
    """Register ``meshtorch train`` on an argparse sub-parsers object. Every flag is checked before data is loaded
    (:meth:`meshtorch.runtime.train_config.TrainConfig.checked`; a new flag also gets a field there)."""
    p = subparsers.add_parser("train", help="train a Transformer LM (the main job)", formatter_class=HelpFormatter)
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"model size preset (default: {DEFAULT_PRESET}; with --resume: the run's)")
    for flag, typ, what in _OVERRIDES:
        p.add_argument(f"--{flag}", type=typ, default=None,
                       help=f"{what} (default: the preset's; with --resume: the run's)")
    p.add_argument("--activation", default=None, choices=["relu", "gelu", "gelu_tanh", "silu"],
                   help="feed-forward activation (default: the preset's)")
    p.add_argument("--gated", action="store_true", default=None, help="gated feed-forward (GEGLU/SwiGLU)")
    p.add_argument("--norm", default=None, choices=["rms", "layer"], help="normalization (default: the preset's)")
    p.add_argument("--remat", default=None, choices=list(REMAT_POLICIES),
                   help="activation checkpointing (default: none; with --resume: the run's): none; block (recompute "
                        "each block's activations in the backward pass, keep only block inputs); selective (keep "
                        "matmul and attention outputs, recompute the elementwise ops). The planner's memory check "
                        "counts it")
    p.add_argument("--pipeline-stages", type=int, default=None,
                   help="run the blocks as a pipeline of this many stages, their weights stacked on a 'stage' "
                        "dimension that the layout splits (e.g. --layout 'stage:pipe;batch:data'); default: the size "
                        "of the mesh axis the layout maps 'stage' to (no pipeline if it names none). --layers must "
                        "equal stages x --pipeline-repeats (docs/pipeline.md)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline: microbatches per step, a divisor of --batch-size (default: the stages); the idle "
                        "fraction is (stages - 1) / (microbatches x repeats + stages - 1)")
    p.add_argument("--pipeline-repeats", type=int, default=None,
                   help="pipeline: circular repeats R, stage s running layers s, S + s, ... (default: --layers / "
                        "stages; R > 1 needs --microbatches >= stages)")
    p.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                   help="pipeline schedule: gpipe runs the pipeline layout's fill-drain program; 1f1b, "
                        "interleaved-1f1b and zero-bubble run one program per stage in the schedule's order (the "
                        "stage executor; under torchrun one process per pipeline rank; docs/pipeline.md)")
    p.add_argument("--pipeline-trace", default="", metavar="FILE",
                   help="with --pipeline-schedule 1f1b, interleaved-1f1b or zero-bubble: write every training "
                        "step's per-rank timeline (one slice per action, e.g. 1F3, and its receives, sends and "
                        "waits) as a Chrome / Perfetto trace JSON to FILE (open it in ui.perfetto.dev or "
                        "chrome://tracing; under torchrun rank 0 writes every rank's) and print the measured "
                        "bubble fraction per rank beside the schedule table's (docs/pipeline.md)")
    p.add_argument("--mesh", default=None,
                   help='mesh shape axis:size,... with positive integer sizes, e.g. "data:2,model:2"; "" = 1 '
                        f'processor. Default: "{DEFAULT_MESH}" in one process (simulated); under torchrun with '
                        f'neither --mesh nor --layout, data parallel over the N processes: "data:N" with layout '
                        f'"{DATA_PARALLEL_LAYOUT}" (like DistributedDataParallel). Under torchrun the mesh has one '
                        "processor per process")
    p.add_argument("--layout", default=None,
                   help="layout rules tensor_dim:mesh_axis;... (each must name a model dimension and a mesh axis), or "
                        "auto: the default layout unless one of those the calibrated cost model ranks best on "
                        "this machine (meshtorch plan --calibrate; see --auto-candidates; both cached), within "
                        "--memory-limit, measures faster beyond the noise of its steps (at least 5%%). "
                        "Default: "
                        f'"{DEFAULT_LAYOUT}" (under torchrun without --mesh: "{DATA_PARALLEL_LAYOUT}")')
    p.add_argument("--memory-limit", default=None,
                   help="with --layout auto (refused without it): bytes per processor the layout may need, e.g. "
                        "16GiB (predicted by the planner)")
    p.add_argument("--auto-candidates", type=int, default=None,
                   help="with --layout auto (refused without it): at least how many of the cost model's best "
                        "layouts to train a few steps each (with the default layout and every layout predicted "
                        "within the ranking's trust band, up to 20%% of a 600-step default run) before training with "
                        "the default unless one is faster beyond the noise; the choice is cached, so the next run of "
                        "the same job measures nothing; 0: take the cost model's first unmeasured (default 3)")
    p.add_argument("--device", default=None,
                   help="where the slices live: cpu, cuda (a simulated mesh spreads its processors over the visible "
                        "GPUs round-robin; under torchrun each rank uses cuda:LOCAL_RANK with NCCL) or cuda:<index> "
                        "(default: cpu; under torchrun cuda:LOCAL_RANK when CUDA is available)")
    p.add_argument("--storage", default="",
                   help='storage layout rules for variables, e.g. "d_model:data" (FSDP: weights all-gathered for '
                        "compute, gradients reduce-scattered); auto (with --layout auto): searched with the layout")
    p.add_argument("--data", nargs="*", default=None,
                   help="UTF-8 text files, or directories of .txt/.md/.rst files (default: the built-in corpus)")
    p.add_argument("--tokenizer", default=None, choices=["byte", "sentencepiece"],
                   help="UTF-8 bytes (the default), or a SentencePiece model trained on the training documents; with "
                        "--init-from the model's tokenizer.json is used (an error if DIR has none), or bytes with "
                        "--tokenizer byte")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"SentencePiece vocabulary size (default: {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--steps", type=int, default=600, help="training steps (in total, counting resumed ones)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "adafactor", "sgd", "momentum"],
                   help="optimizer")
    p.add_argument("--lr", type=float, default=6e-3,
                   help="peak learning rate, finite and > 0 (adafactor: <= 0 = its own schedule)")
    p.add_argument("--schedule", default="cosine", choices=["constant", "linear-warmup", "rsqrt", "cosine"],
                   help="learning-rate schedule")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (adamw, adam)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="gradient accumulation: N microbatches of --batch-size / N per optimizer step (N runs of "
                        "one microbatch's forward and backward, gradients summed in place: the activation memory of "
                        "one microbatch, the losses and updates of the whole batch); N must divide --batch-size")
    p.add_argument("--eval-every", type=int, default=200, help="steps between validation evaluations")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, batches and sampling")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's own choice). One is safe on a busy machine (two were 23x "
                        "slower on 2 loaded cores); on idle cores or for large models more are faster "
                        "(docs/cli-train.md, Threads)")
    p.add_argument("--executor", default="codegen", choices=["codegen", "interpret", "compile"],
                   help="how each step runs: one generated Python function per step (codegen), a loop over the "
                        "program's steps (interpret), or that function through torch.compile (compile: the first "
                        "step compiles, tens of seconds on a CPU; plans with dropout stay uncompiled)")
    p.add_argument("--compile", dest="executor", action="store_const", const="compile",
                   help="shorthand for --executor compile")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="torch.compile's backend under --compile (default inductor; aot_eager captures the same "
                        "one-graph step through dynamo and AOTAutograd without generating kernels: seconds to "
                        "compile; any name torch._dynamo.list_backends gives)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="numerics (docs/precision.md): fp32; tf32 (float32 with TF32 matmuls on CUDA, set in every "
                        "process before any step is compiled); bf16 (float32 master weights and optimizer state, "
                        "bfloat16 matmuls and activations, softmax, loss and norm statistics in float32); fp16 "
                        "(as bf16 in float16, with dynamic loss scaling as torch.amp.GradScaler; adam/adamw only)")
    p.add_argument("--reduce-dtype", default="float32", choices=list(REDUCE_DTYPES),
                   help="dtype of the gradient all-reduces / reduce-scatters under --precision bf16 (FSDP2's "
                        "reduce_dtype; default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the whole job's peak FLOP/s in TFLOP/s, the MFU denominator (default: a float32 matmul "
                        "loop measured at start, the best of several rounds, scaled to the job's cores)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="issue gradient all-reduces (and, with --storage, weight all-gathers and gradient "
                        "reduce-scatters) in buckets of at most this many MiB per processor, one collective call "
                        "each (DDP's bucket_cap_mb, FSDP's flat parameters; 0: one call per variable). Default: "
                        "DDP's, 25 MiB buckets and a first all-reduce bucket of 1 MiB, started while the backward "
                        "pass goes on")
    p.add_argument("--async-collectives", action=argparse.BooleanOptionalAction, default=None,
                   help="under torchrun: start every collective asynchronously and wait at first use, so they "
                        "overlap compute (DDP's / FSDP's overlap; the default on CUDA); --no-async-collectives: all "
                        "blocking. Default on CPU: all-reduces of >= 1 MiB (gradient buckets) asynchronous, the rest "
                        "blocking, as gloo competes with compute for the cores")
    p.add_argument("--runs-dir", default="runs",
                   help="where runs live: each run in <runs-dir>/<run-name>/ (ckpt/, loss.png), and "
                        "<runs-dir>/latest names the newest run")
    p.add_argument("--run-name", default=None,
                   help="this run's name (default: a UTC timestamp such as 20261125-123456; with --resume: the run "
                        "<runs-dir>/latest names)")
    p.add_argument("--plot", default=None, help="loss-curve PNG path (default: <runs-dir>/<run-name>/loss.png; '' to "
                                                 "skip)")
    p.add_argument("--trace-collectives", action="store_true",
                   help="after training, print the time per collective kind and mesh axes and the slowest "
                        "collectives this process ran (from the flight recorder)")
    p.add_argument("--comm-detail", action="store_true",
                   help="list the communication per causing op too (default: per layer or op family and collective)")
    p.add_argument("--log-dir", default="",
                   help="write TensorBoard event files and metrics.jsonl here ('' to skip)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (default: <runs-dir>/<run-name>/ckpt; atomic, restorable on any "
                        "layout; `meshtorch sample` reads the latest run's; '' for none)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep", type=int, default=3,
                   help="keep this run's newest N checkpoints (another run's are never deleted)")
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_mode, metavar="auto",
                   help="continue the newest checkpoint of the latest run (or of --run-name / --checkpoint-dir) with "
                        "its model flags (and --init-from) taken from its run.json; an error if there is none, if a "
                        "model flag given differs from the run's, or if its data differ. '--resume auto': continue "
                        "the run named by --run-name / --checkpoint-dir if it has a checkpoint, else start it (the "
                        "same command for every attempt of a restarted job, e.g. under torchrun --max-restarts)")
    p.add_argument("--resume-from", default=None,
                   help="continue from this checkpoint directory (e.g. an older ckpt-<step> when the newest is "
                        "damaged); new checkpoints go beside it unless --checkpoint-dir is given")
    p.add_argument("--force-data", action="store_true",
                   help="with --resume / --resume-from (refused without them): continue on data that differ from "
                        "the checkpoint's (the data position starts over)")
    p.add_argument("--sample", type=int, default=200, help="tokens to sample after training (0: none)")
    p.add_argument("--prompt", default="The ", help="prompt of the sample")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune the Hugging Face GPT-2 / Llama model in DIR (config.json + safetensors; its "
                        "tokenizer.json tokenizes --data) in the same loop, run directory and checkpoints as a "
                        "native run. The model comes from DIR: --preset, the size flags, --dropout, --experts, "
                        "--tokenizer sentencepiece are refused; --layout auto searches its graph (not T5's; "
                        "docs/huggingface.md); default --batch-size 8, --length the model's positions up to 128")
    p.add_argument("--start-step", type=_start_step, default=0, metavar="N",
                   help="with --init-from: continue an exported run as if N steps were done (the step meshtorch "
                        "export printed): the learning-rate schedule and step count start at N, the data N batches "
                        "in (each step takes one --batch-size batch), and --steps counts in total, as with --resume. "
                        "With plain --optimizer sgd (an export has no optimizer state) the losses equal --resume's "
                        "(docs/huggingface.md)")
    p.set_defaults(func=main_train)


add_parser = add_train_subcommand  # the cli's module protocol
