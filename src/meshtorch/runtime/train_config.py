"""``meshtorch train``'s typed configuration: one frozen :class:`TrainConfig`, built from the parsed
arguments once (:meth:`TrainConfig.from_args`) and checked once (:meth:`TrainConfig.checked`) before data
is loaded or the model built; :func:`meshtorch.runtime.train.main_train` reads only it.

A new ``meshtorch train`` flag: add its argparse line in :mod:`meshtorch.cli.train` and a field here with
the same name (the argparse ``dest``) and the same default, in the group it belongs to;
``tests/test_train_config.py`` checks that the two agree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from meshtorch.checkpoint import hf, latest_checkpoint, load_manifest
from meshtorch.core.errors import CheckpointError, UsageError
from meshtorch.core.layout import LayoutRules
from meshtorch.core.mesh_spec import MeshSpec
from meshtorch.lowering.session import check_compile_backend
from meshtorch.models.transformer import build_lm, preset
from meshtorch.ops.precision import PrecisionPolicy
from meshtorch.planning.pipeline import schedule_flag as pipeline_schedule_flag
from meshtorch.runtime import checks, hf_train, pipeline_train, runs
from meshtorch.runtime.autolayout import choose_layout
from meshtorch.runtime.calibrate import cached
from meshtorch.runtime.optional import optional_module
from meshtorch.runtime.plan_lm import parse_bytes

DEFAULT_MESH = "data:2,model:2"
DEFAULT_PRESET = "small"
DEFAULT_VOCAB_SIZE = 1024  # --tokenizer sentencepiece's vocabulary
AUTO_CANDIDATES = 3  # --layout auto measures at least this many of the cost model's best layouts (--auto-candidates)
DEFAULT_LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"
DATA_PARALLEL_LAYOUT = "batch:data"


def default_mesh_layout(mesh: str | None, layout: str | None, world: int) -> tuple[str, str]:
    """``--mesh`` and ``--layout`` with their defaults filled in, for a job of ``world`` processes.

    Neither given under torchrun (``world`` > 1): data parallel over every process, mesh ``data:<world>``
    and layout ``batch:data`` (what ``torch.nn.parallel.DistributedDataParallel`` does with the same
    launch). Otherwise a missing ``--mesh`` is :data:`DEFAULT_MESH` and a missing ``--layout``
    :data:`DEFAULT_LAYOUT` (one process: the simulated ``data:2,model:2`` mesh; under torchrun an explicit
    ``--mesh`` must still have ``world`` processors, see :func:`meshtorch.runtime.checks.mesh_fits_world`).
    """
    if world > 1 and mesh is None and layout is None:
        return f"data:{world}", DATA_PARALLEL_LAYOUT
    return (DEFAULT_MESH if mesh is None else mesh), (DEFAULT_LAYOUT if layout is None else layout)


@dataclass(frozen=True)
class TrainConfig:
    """Every ``meshtorch train`` setting, named as its flag (``--d-model`` -> ``d_model``) with the flag's
    default (see ``meshtorch train --help`` and docs/cli-train.md for each meaning). Frozen: a resolved
    value (the run's checkpoint directory, ``--layout auto``'s choice) is a new config
    (:meth:`checked`), never a changed one."""

    # model: a preset and its overrides (None: the preset's value; on --resume: the run's, from its record;
    # with --init-from: refused, the model comes from DIR)
    preset: str | None = None  # None: "small" (DEFAULT_PRESET)
    layers: int | None = None
    d_model: int | None = None
    heads: int | None = None
    d_kv: int | None = None
    d_ff: int | None = None
    length: int | None = None
    batch_size: int | None = None
    dropout: float | None = None
    experts: int | None = None
    activation: str | None = None
    gated: bool | None = None
    norm: str | None = None
    remat: str | None = None  # None: "none"
    # pipeline (docs/pipeline.md): None = resolved by checked() (stages from the layout's 'stage' axis)
    pipeline_stages: int | None = None
    microbatches: int | None = None
    pipeline_repeats: int | None = None
    pipeline_schedule: str | None = None  # --pipeline-schedule: gpipe = the layout; others: runtime.pipeline_train
    pipeline_trace: str = ""  # --pipeline-trace FILE: the stage executor's Chrome trace (runtime.pipeline_trace)
    # mesh and layout
    # None: default_mesh_layout's (under torchrun without either flag: data:<world> and batch:data)
    mesh: str | None = None
    layout: str | None = None
    memory_limit: str | None = None
    auto_candidates: int | None = None  # None: 3 (AUTO_CANDIDATES)
    device: str | None = None
    storage: str = ""
    # data
    data: tuple[str, ...] | None = None
    tokenizer: str | None = None  # None: "byte"; with --init-from the model's tokenizer.json
    vocab_size: int | None = None  # None: 1024 (DEFAULT_VOCAB_SIZE)
    # optimization
    steps: int = 600
    optimizer: str = "adamw"
    lr: float = 6e-3
    schedule: str = "cosine"
    warmup_steps: int = 50
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    accumulate: int = 1  # gradient accumulation: microbatches per optimizer step (meshtorch.optim.accumulate)
    eval_every: int = 200
    eval_batches: int = 8
    seed: int = 0
    # execution
    threads: int = 1
    executor: str = "codegen"
    compile_backend: str = "inductor"  # torch.compile's backend under --compile
    precision: str = "fp32"  # fp32 | tf32 | bf16 (meshtorch.ops.precision.PrecisionPolicy.named)
    reduce_dtype: str = "float32"  # float32 | bfloat16: gradient reductions under bf16
    peak_tflops: float | None = None
    bucket_mb: float | None = None  # None: the Lowering's default (DDP's: 25 MiB, first bucket 1 MiB)
    async_collectives: bool | None = None
    # runs, outputs and reports
    runs_dir: str = "runs"
    run_name: str | None = None
    plot: str | None = None
    trace_collectives: bool = False
    comm_detail: bool = False
    log_dir: str = ""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep: int = 3
    resume: bool | str = False  # True (--resume), False, or "auto" (--resume auto: resume if a checkpoint exists)
    resume_from: str | None = None
    force_data: bool = False
    # sampling after training
    sample: int = 200
    prompt: str = "The "
    temperature: float = 0.8
    top_k: int = 40
    # the model: a Hugging Face GPT-2 / Llama directory instead of a preset (meshtorch.runtime.hf_train)
    init_from: str | None = None
    start_step: int = 0  # --start-step N: an --init-from run continues an exported run at step N

    @classmethod
    def from_args(cls, args) -> TrainConfig:
        """The config of an argparse Namespace (or any object with these attributes; a TrainConfig is
        returned as it is). An attribute the object lacks takes the field's default; others are ignored."""
        if isinstance(args, cls):
            return args
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if values.get("data") is not None:
            values["data"] = tuple(values["data"])
        return cls(**values)

    def replace(self, **changes) -> TrainConfig:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @property
    def resuming(self) -> bool:
        """``--resume`` or ``--resume-from`` was given."""
        return bool(self.resume or self.resume_from)

    @property
    def precision_policy(self) -> PrecisionPolicy:
        """The :class:`~meshtorch.ops.precision.PrecisionPolicy` of ``--precision`` and ``--reduce-dtype``."""
        return PrecisionPolicy.named(self.precision, self.reduce_dtype)

    @property
    def bucket_bytes(self) -> int | None:
        """``--bucket-mb`` in bytes (None when not given: the :class:`~meshtorch.Lowering`'s default)."""
        return None if self.bucket_mb is None else int(self.bucket_mb * 2 ** 20)

    def checked(self) -> tuple[TrainConfig, runs.RunPaths]:
        """Check every flag before data is loaded or the model built; returns the config with its run's
        paths, data files and ``--layout auto`` / ``--storage auto`` resolved, and the run's name and paths
        (:func:`meshtorch.runtime.runs.resolve_run`).

        Raises:
            UsageError: naming the flag (a number out of range, an unwritable output path, a missing
                input file, a mesh size that is not a positive integer, a prompt longer than the context,
                a ``--resume`` with nothing to resume).
            LayoutError: naming a ``--layout``/``--storage`` rule that matches no dimension of the model or no
                axis of the mesh, listing both.
        """
        self._check_numbers()
        self._check_start_step()
        self._check_dependent_flags()
        cfg = self._with_mesh_defaults()._with_auto_resume()
        mesh = checks.mesh_shape("--mesh", cfg.mesh)
        checks.mesh_fits_world("--mesh", cfg.mesh, mesh, world_size())
        checks.device("--device", cfg.device)
        if cfg.resume and cfg.checkpoint_dir == "":
            raise UsageError("--resume needs --checkpoint-dir (the directory holding the checkpoints), not ''.")
        if cfg.resume_from and not os.path.isdir(cfg.resume_from):
            raise UsageError(f"--resume-from {cfg.resume_from!r} is not a checkpoint directory.")
        paths = runs.resolve_run(cfg)
        cfg = cfg.replace(checkpoint_dir=paths.checkpoint_dir, plot=paths.plot)
        point = None
        if cfg.resume and not cfg.resume_from:
            point = resume_point(cfg.checkpoint_dir, None) if os.path.isdir(cfg.checkpoint_dir) else (None,)
            if point[0] is None:  # a damaged newest checkpoint was reported by resume_point, before any work
                raise runs.nothing_to_resume("--resume", cfg.checkpoint_dir)
            point = point[0]
        elif cfg.resume_from:
            point = cfg.resume_from
        if point is not None and os.path.isfile(os.path.join(point, "manifest.json")):
            cfg = cfg._with_run_flags(load_manifest(point).get("extra") or {})
        if cfg.init_from:
            hf_train.refuse_flags(cfg)
        else:
            cfg = cfg._with_native_defaults()
        data = checks.input_files("--data", cfg.data)
        cfg = cfg.replace(data=None if data is None else tuple(data))
        runs.check_paths(paths, resuming=cfg.resuming)
        if cfg.pipeline_trace and cfg.pipeline_schedule not in pipeline_train.EXECUTED:
            raise UsageError(f"--pipeline-trace needs the stage executor: --pipeline-schedule "
                             f"{'|'.join(pipeline_train.EXECUTED)} (got {cfg.pipeline_schedule or 'none'}; gpipe "
                             "runs the pipeline layout's one program, which has no per-action timeline).")
        checks.writable_file("--pipeline-trace", cfg.pipeline_trace)
        if cfg.log_dir:
            checks.writable_dir("--log-dir", cfg.log_dir)
            optional_module("tensorboard", "meshtorch train --log-dir")
        if cfg.init_from:
            if cfg.layout == "auto" or cfg.storage == "auto":
                hf_train.check_layout_search(cfg, hf_train.model_config(cfg, 1, cfg.saved_record()))
                cfg = cfg._choose_layout()  # measured on fresh weights; the checkpoint loads into the choice
            imported = hf_train.model_config(cfg, 1, cfg.saved_record())
            cfg._check_accumulate(imported.batch_size)
            cfg = cfg._resolve_pipeline(mesh, imported.num_layers, imported.batch_size,
                                        f"the num_layers of {cfg.init_from}/config.json")
            hf_train.check_pipeline(cfg, imported, world_size())
            cfg._check_imported(mesh)
            return cfg, paths
        cfg._check_prompt()
        cfg._check_accumulate(preset(cfg.preset, batch_size=cfg.batch_size).batch_size)
        if cfg.layout == "auto" or cfg.storage == "auto":
            cfg = cfg._choose_layout()  # with --microbatches, pipelined layouts are candidates too
        base = preset(cfg.preset, num_layers=cfg.layers, batch_size=cfg.batch_size)
        cfg = cfg._resolve_pipeline(mesh, base.num_layers, base.batch_size)
        names = checks.graph_dim_names(build_lm(cfg._probe_model()).graph)
        checks.layout_rules("--layout", cfg.layout, names, mesh)
        checks.layout_rules("--storage", cfg.storage, names, mesh)
        return cfg, paths

    def _with_auto_resume(self) -> TrainConfig:
        """``--resume auto``: resume when the run's checkpoint directory holds a checkpoint, else start the run
        (what a job restarted by torchrun's ``--max-restarts`` or a cluster scheduler needs: the same command
        line every attempt; TorchTitan's checkpoint auto-load, Levanter's ``load_checkpoint=None``).

        Raises:
            UsageError: naming ``--resume auto`` when neither ``--run-name`` nor ``--checkpoint-dir`` names the
                run (with an automatic name a restart could neither find its run nor tell it from another), or
                with ``--resume-from``.
        """
        if self.resume != "auto":
            return self
        if self.resume_from:
            raise UsageError("--resume auto and --resume-from: give one (--resume-from names the checkpoint itself).")
        if self.run_name is None and not self.checkpoint_dir:
            raise UsageError("--resume auto needs --run-name or --checkpoint-dir: the run every attempt continues "
                             "(an automatic name differs per attempt).")
        paths = runs.resolve_run(self.replace(resume=False))
        found = os.path.isdir(paths.checkpoint_dir) and latest_checkpoint(paths.checkpoint_dir) is not None
        return self.replace(resume=found)

    def saved_record(self) -> dict:
        """The record (manifest ``extra``) of the checkpoint ``--resume`` / ``--resume-from`` continues ({} when
        not resuming or it has none)."""
        if not self.resuming:
            return {}
        point = self.resume_from or resume_point(self.checkpoint_dir, None)[0]
        if point is None or not os.path.isfile(os.path.join(point, "manifest.json")):
            return {}
        return load_manifest(point).get("extra") or {}

    def _with_run_flags(self, saved: dict) -> TrainConfig:
        """``--resume``: the model flags not given taken from the resumed run's record (its model config,
        preset, tokenizer and ``--init-from``), so a run continues without retyping them.

        Raises:
            UsageError: naming the flag, when one is given and differs from the run's value.
        """
        config, imported = saved.get("config") or {}, "hf_config" in saved
        changes = {}
        src = saved.get("init_from")
        if imported and src and self.init_from and os.path.abspath(self.init_from) != src:
            raise UsageError(f"--init-from {self.init_from!r} differs from the resumed run's {src!r} (its run.json); "
                             "drop --init-from to continue the run, or start a new run without --resume.")
        if not imported and self.init_from:
            raise UsageError(f"--init-from {self.init_from!r}: the run to resume ({saved.get('run')!r}) trained a "
                             "native LM; drop --init-from to continue it, or start a new run without --resume.")
        if imported and not self.init_from:
            changes["init_from"] = src or ""
        for flag, key in (("preset", "preset"), ("tokenizer", "tokenizer")):
            if getattr(self, flag) is None and saved.get(key) is not None:
                changes[flag] = saved[key]
        for flag, key in _RUN_FLAGS.items():
            if key not in config or (imported and flag not in ("length", "batch_size", "remat")):
                continue
            given = getattr(self, flag)
            if given is None:
                changes[flag] = config[key]
            elif given != config[key]:
                name = "--" + flag.replace("_", "-")
                raise UsageError(f"{name} {given!r} differs from the resumed run's {config[key]!r} (model config field "
                                 f"{key!r} in its run.json); drop {name} to continue the run as it was, or start a new "
                                 "run without --resume.")
        return self.replace(**changes)

    def _check_accumulate(self, batch_size: int) -> None:
        """``--accumulate N``: ``batch_size`` (the run's ``--batch-size``, resolved) split into N equal microbatches.

        Raises:
            UsageError: naming ``--accumulate``: N < 1, N not dividing the batch, or with ``--layout auto``.
        """
        n = self.accumulate
        if batch_size % n:
            raise UsageError(f"--accumulate {n} does not divide --batch-size {batch_size}: each optimizer step "
                             f"splits the batch into {n} equal microbatches; give a --batch-size that is a "
                             f"multiple of {n}.")
        if n > 1 and "auto" in (self.layout, self.storage):
            raise UsageError(f"--accumulate {n} cannot be combined with --layout auto / --storage auto yet (the "
                             "search plans the whole batch); give --layout (and --storage) rules.")
        split = MeshSpec(self.mesh, self.layout).axis_size_for("batch") if n > 1 and self.layout != "auto" else 1
        if (batch_size // n) % split:
            raise UsageError(f"--accumulate {n}: a microbatch of {batch_size // n} sequences (--batch-size "
                             f"{batch_size} / {n}) does not split over the {split} processors that --layout "
                             f"{self.layout!r} splits 'batch' over; give a --batch-size that is a multiple of "
                             f"{n * split}.")

    def _with_native_defaults(self) -> TrainConfig:
        """A native run's ``--preset``, ``--tokenizer``, ``--remat``, ``--gated`` and ``--vocab-size`` defaults
        filled in."""
        return self.replace(preset=self.preset or DEFAULT_PRESET, tokenizer=self.tokenizer or "byte",
                            remat=self.remat or "none", gated=bool(self.gated),
                            vocab_size=self.vocab_size or DEFAULT_VOCAB_SIZE)

    def _check_dependent_flags(self) -> None:
        """Flags that only act with another flag: ``--force-data`` with ``--resume`` / ``--resume-from``;
        ``--memory-limit`` and ``--auto-candidates`` with ``--layout auto`` / ``--storage auto`` (native or
        ``--init-from``).

        Raises:
            UsageError: naming the flag and the one it needs (given alone it would be silently ignored).
        """
        if self.force_data and not self.resuming:
            raise UsageError("--force-data continues a checkpoint on other data: it needs --resume or --resume-from "
                             "(this run starts from scratch); drop --force-data.")
        if "auto" in (self.layout, self.storage):
            return
        for flag, value in (("--memory-limit", self.memory_limit), ("--auto-candidates", self.auto_candidates)):
            if value is not None:
                raise UsageError(f"{flag} {value} is for the layout search: add --layout auto, or drop {flag}.")

    def _check_start_step(self) -> None:
        """``--start-step N``: only for an ``--init-from`` run, and below ``--steps``. With ``--resume auto`` it
        applies when the run starts (a restarted attempt continues the run's checkpoint instead).

        Raises:
            UsageError: naming ``--start-step``: negative, without ``--init-from``, with ``--resume`` or
                ``--resume-from`` (the checkpoint holds the step), or not below ``--steps``.
        """
        n = self.start_step
        if not n:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UsageError(f"--start-step must be a whole number of steps >= 0, got {n!r}.")
        if self.resume is True or self.resume_from:
            raise UsageError(f"--start-step {n} cannot be combined with --resume / --resume-from: the checkpoint "
                             "holds the step and the data position.")
        if not self.init_from:
            raise UsageError(f"--start-step {n} continues an exported model (--init-from DIR); a native run "
                             "continues with --resume.")
        if n >= self.steps:
            raise UsageError(f"--start-step {n}: --steps {self.steps} counts steps in total (as with --resume); "
                             f"give --steps above {n} to train.")

    def _check_imported(self, mesh) -> None:
        """``--init-from``: the model directory, its tokenizer, the prompt and the layout rules, checked before
        anything is loaded (:mod:`meshtorch.runtime.hf_train`)."""
        model = hf_train.model_config(self, vocab_multiple(self.mesh, self.layout), self.saved_record())
        tok = hf_train.tokenizer(self, model)
        if self.sample and not model.encoder_decoder:  # T5: no end-of-run sample (meshtorch sample decodes it)
            hf_train.check_prompt(tok, self.prompt, model.length)
        probe = max(1, model.pipeline_stages) * model.pipeline_repeats  # one layer (one stacked pipeline)
        names = checks.graph_dim_names(hf.build(model.replace(num_layers=probe)).graph)
        checks.layout_rules("--layout", self.layout, names, mesh)
        checks.layout_rules("--storage", self.storage, names, mesh)

    def _with_mesh_defaults(self) -> TrainConfig:
        """The config with ``--mesh`` / ``--layout`` defaults filled in (:func:`default_mesh_layout`); under
        torchrun without either flag, rank 0 says once that the job is data parallel."""
        world = world_size()
        mesh, layout = default_mesh_layout(self.mesh, self.layout, world)
        if world > 1 and self.mesh is None and self.layout is None and _rank() == 0:
            print(f"meshtorch train: no --mesh/--layout under torchrun: data parallel over the {world} processes "
                  f"(--mesh {mesh} --layout {layout}; the DistributedDataParallel equivalent)", flush=True)
        return self.replace(mesh=mesh, layout=layout)

    def _check_numbers(self) -> None:
        for flag in ("layers", "d_model", "heads", "d_kv", "d_ff", "length", "batch_size", "steps", "eval_every",
                     "eval_batches", "vocab_size", "keep"):
            checks.positive("--" + flag.replace("_", "-"), getattr(self, flag))
        checks.positive("--accumulate", self.accumulate)
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int):
            raise UsageError(f"--accumulate must be a whole number of microbatches, got {self.accumulate!r}.")
        if self.experts is not None:
            checks.non_negative("--experts", self.experts)
        for flag in ("threads", "warmup_steps", "weight_decay", "clip_norm", "checkpoint_every", "sample",
                     "temperature", "top_k", "bucket_mb"):
            if getattr(self, flag) is not None:
                checks.non_negative("--" + flag.replace("_", "-"), getattr(self, flag))
        checks.positive("--peak-tflops", self.peak_tflops)
        checks.fraction("--dropout", self.dropout)
        try:
            PrecisionPolicy.named(self.precision, self.reduce_dtype)
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            check_compile_backend(self.compile_backend)
        except ValueError as e:
            raise UsageError(f"--compile-backend: {e}") from None
        if self.precision == "fp16" and (self.optimizer not in ("adam", "adamw") or self.accumulate > 1
                                         or self.init_from):
            raise UsageError("--precision fp16 (dynamic loss scaling) runs with --optimizer adamw or adam, without "
                             "--accumulate and --init-from; use --precision bf16 for those.")
        if self.optimizer == "adafactor":
            checks.number("--lr", self.lr)  # <= 0: Adafactor's own schedule
        else:
            checks.positive("--lr", self.lr)

    def _resolve_pipeline(self, mesh, num_layers: int, batch_size: int, layers_flag: str = "--layers") -> TrainConfig:
        """The config with ``--pipeline-stages/--microbatches/--pipeline-repeats`` resolved for a model of
        ``num_layers`` and ``batch_size`` (stages from the mesh axis the layout maps ``stage`` to;
        :func:`meshtorch.runtime.checks.pipeline_fields` raises UsageError naming the flag for a combination the
        model or mesh cannot run; ``--accumulate`` with a pipeline is refused)."""
        pipe = checks.pipeline_fields(self.layout, mesh, self.pipeline_stages, self.microbatches,
                                      self.pipeline_repeats, num_layers, batch_size, layers_flag)
        if self.accumulate > 1 and pipe["pipeline_stages"] > 1:
            raise UsageError(f"--accumulate {self.accumulate} cannot be combined with a pipelined --layout "
                             f"({self.layout!r}): a pipeline already splits the batch into --microbatches; use "
                             "--microbatches, or a layout without 'stage'.")
        if self.pipeline_schedule is not None:
            pipeline_schedule_flag(self.pipeline_schedule, pipe["pipeline_stages"], pipe["microbatches"],
                                   pipe["pipeline_repeats"])
        cfg = self.replace(**pipe)
        if cfg.pipeline_schedule in pipeline_train.EXECUTED:  # run by the stage executor: what it cannot run
            pipeline_train.check_flags(cfg, mesh, world_size())
        return cfg

    def pipeline_fields(self) -> dict:
        """The resolved pipeline fields of the model config (``LMConfig.pipeline_stages`` etc.)."""
        return {f: getattr(self, f) for f in ("pipeline_stages", "microbatches", "pipeline_repeats")}

    def _probe_model(self):
        """The model config with one layer (one pipeline of S x R layers) and the byte vocabulary: enough for
        the dimension names and the context length, cheap to build."""
        pipe = {k: v for k, v in self.pipeline_fields().items() if v is not None}
        layers = max(pipe.get("pipeline_stages", 0), 1) * pipe.get("pipeline_repeats", 1)
        return preset(self.preset, num_layers=layers, d_model=self.d_model, num_heads=self.heads, d_kv=self.d_kv,
                      d_ff=self.d_ff, length=self.length, batch_size=self.batch_size, gated=self.gated or None,
                      vocab_size=256, num_experts=self.experts, **pipe)

    def _check_prompt(self) -> None:
        if self.sample and not self.prompt:
            raise UsageError("--prompt is empty; sampling needs at least one prompt character (or --sample 0).")
        length = preset(self.preset, length=self.length).length
        if self.sample and self.tokenizer == "byte" and len(self.prompt.encode("utf-8")) >= length:
            raise UsageError(f"--prompt is {len(self.prompt.encode('utf-8'))} bytes, but the model's context is "
                             f"{length} tokens (--length); give a shorter prompt or a longer --length.")

    def _choose_layout(self) -> TrainConfig:
        """``--layout auto`` / ``--storage auto``: the config with the default layout unless one measures faster
        beyond the noise among the layouts (and storage rules) the calibrated cost model ranks best for this model
        and mesh within ``--memory-limit`` (the best ``--auto-candidates`` and the default layout,
        :func:`meshtorch.runtime.autolayout.choose_layout`);
        under torchrun the calibration must be cached (every rank reads the same file, so all rank alike).

        Raises:
            UsageError: ``--storage auto`` without ``--layout auto``, under torchrun without a cached
                calibration, or when no layout fits ``--memory-limit``.
        """
        world = world_size()
        backend = "placement" if world == 1 else ("nccl" if str(self.device or "").startswith("cuda") else "gloo")
        threads = self.threads or torch.get_num_threads()
        if world > 1 and cached(backend, threads) is None:
            raise UsageError(f"--layout auto under torchrun needs this machine's calibration: run 'meshtorch plan "
                             f"--calibrate --backend {backend} --threads {threads}' once first.")
        storage = self.storage or ""
        if self.layout != "auto":
            raise UsageError("--storage auto needs --layout auto (the search picks the storage rules together with "
                             "the layout).")
        limit = parse_bytes(self.memory_limit) if self.memory_limit else None
        vocab = 256 if self.tokenizer == "byte" else self.vocab_size

        def config(multiple):
            if self.init_from:  # the imported model (its config.json), the vocab padded for the candidate
                return hf_train.model_config(self, multiple, self.saved_record())
            return preset(self.preset, num_layers=self.layers, d_model=self.d_model, num_heads=self.heads,
                          d_kv=self.d_kv, d_ff=self.d_ff, length=self.length, batch_size=self.batch_size,
                          gated=self.gated or None, vocab_size=vocab, vocab_multiple=multiple,
                          num_experts=self.experts, remat=self.remat)

        say = print if _rank() == 0 else (lambda *a: None)
        candidates = AUTO_CANDIDATES if self.auto_candidates is None else self.auto_candidates
        layout, chosen_storage, remat = choose_layout(config, self.mesh, storage=storage, memory_limit=limit,
                                               backend=backend, threads=threads, print_fn=say,
                                               microbatches=self.microbatches, candidates=candidates,
                                               device=self.device, executor=self.executor, world=world,
                                               precision=self.precision_policy)
        changes = {}  # a chosen pipeline stacks every layer: _resolve_pipeline's default repeats
        if self.microbatches is not None and "stage" not in dict(LayoutRules(layout).pairs):
            say(f"--layout auto chose no pipeline, so --microbatches {self.microbatches} is not used.")
            changes = {"microbatches": None, "pipeline_repeats": None}
        if remat:
            changes["remat"] = remat
        # "": storage rules to fit the limit
        return self.replace(layout=layout, storage=chosen_storage if storage in ("", "auto") else storage, **changes)


#: the model flags --resume takes from the run's record: TrainConfig field -> model config field
_RUN_FLAGS = {"layers": "num_layers", "d_model": "d_model", "heads": "num_heads", "d_kv": "d_kv", "d_ff": "d_ff",
              "length": "length", "batch_size": "batch_size", "dropout": "dropout", "activation": "activation",
              "gated": "gated", "norm": "norm", "experts": "num_experts", "remat": "remat"}


def vocab_multiple(mesh_shape: str, layout: str) -> int:
    """The mesh-axis size that splits ``vocab`` under ``layout`` (1 if none): the vocabulary is padded to a
    multiple of it (Megatron's make-vocab-size-divisible-by)."""
    return MeshSpec(mesh_shape, layout).axis_size_for("vocab")


def world_size() -> int:
    """The job's process count (torchrun's ``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def older_hint(older: list[str]) -> str:
    """What to do when a checkpoint cannot be resumed: the older checkpoints to pass to ``--resume-from``."""
    if not older:
        return "there is no older checkpoint; start without --resume"
    return f"older checkpoints: {', '.join(older)}; resume from one with --resume-from {older[0]}"


def resume_point(checkpoint_dir: str, resume_from: str | None):
    """``(path, older)``: the checkpoint to resume from (``resume_from``, or the newest ``ckpt-<step>`` in
    ``checkpoint_dir``; None if there is none) and the older ones.

    Raises:
        CheckpointError: if the newest checkpoint directory has no readable manifest, naming it and the
            older ones to pass to ``--resume-from``.
    """
    if resume_from:
        return resume_from, []
    dirs = checks.step_dirs(checkpoint_dir)
    if not dirs:
        return None, []
    try:
        load_manifest(dirs[0])
    except CheckpointError as e:
        raise CheckpointError(f"--resume: the newest checkpoint {dirs[0]!r} is unreadable ({e}); "
                              f"{older_hint(dirs[1:])}.") from None
    return dirs[0], dirs[1:]


__all__ = ["DATA_PARALLEL_LAYOUT", "DEFAULT_LAYOUT", "DEFAULT_MESH", "DEFAULT_PRESET", "DEFAULT_VOCAB_SIZE",
           "TrainConfig", "default_mesh_layout", "older_hint", "resume_point", "vocab_multiple"]
