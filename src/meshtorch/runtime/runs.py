"""Run identity for ``meshtorch train`` / ``sample``: where a run keeps its checkpoints, its manifest,
and whether a checkpoint may be resumed by this run.

By default every run gets its own directory ``<runs-dir>/<run-name>/`` (``runs/20261125-123456/``:
``ckpt/`` with the checkpoints and ``run.json``, ``loss.png``), and ``<runs-dir>/latest`` (a symlink,
or a one-line text file where symlinks are not available) names the newest run, which
``meshtorch sample`` and ``meshtorch train --resume`` follow by default. Two runs therefore never
share retention (``--keep``) or resume each other's checkpoints by accident; a checkpoint's manifest
records its run (``extra["run"]``), and retention in a shared ``--checkpoint-dir`` deletes only the
saving run's own checkpoints (:func:`meshtorch.checkpoint.save` with ``run=``).

A resumed checkpoint must match the new run's model configuration, tokenizer and data
(:func:`resume_mismatch`): the data are identified by :func:`data_fingerprint` (SHA-256 of the
documents), so a resume on another corpus is refused unless ``--force-data`` asks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass

from meshtorch._version import __version__
from meshtorch.checkpoint import latest_checkpoint
from meshtorch.core.errors import UsageError
from meshtorch.runtime import checks

LATEST = "latest"
RUN_MANIFEST = "run.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: model config fields that may differ on resume (they follow the layout, not the model)
#: the pipeline fields: a checkpoint of the pipeline layout (stacked variables) and one of an unpipelined run or the
#: stage executor (per-layer variables) restore into each other (meshtorch.checkpoint.stacked)
_PIPELINE_FIELDS = ("pipeline_stages", "microbatches", "pipeline_repeats", "pipeline_remat")
_LAYOUT_FIELDS = {"vocab_multiple", *_PIPELINE_FIELDS, "pipeline_poison_bubbles"}
#: the ``meshtorch train`` flag of each model config field (for error messages)
_FLAG = {"num_layers": "--layers", "d_model": "--d-model", "num_heads": "--heads", "d_kv": "--d-kv", "d_ff": "--d-ff",
         "length": "--length", "batch_size": "--batch-size", "dropout": "--dropout", "activation": "--activation",
         "gated": "--gated", "norm": "--norm", "num_experts": "--experts", "vocab_size": "--vocab-size/--tokenizer"}


@dataclass
class RunPaths:
    """Where one ``meshtorch train`` run writes.

    Attributes:
        name: the run name (also its id in checkpoint manifests; retention deletes only its checkpoints).
        run_dir: ``<runs-dir>/<name>``.
        checkpoint_dir: the checkpoint root ('' = no checkpoints).
        plot: the loss-curve PNG path ('' = none).
        default_layout: True when the checkpoints go to ``<run_dir>/ckpt`` (then ``latest`` points at the run).
    """

    name: str
    run_dir: str
    checkpoint_dir: str
    plot: str
    default_layout: bool


def default_run_name(shared: bool = True) -> str:
    """A timestamp ``YYYYmmdd-HHMMSS`` (UTC); under ``meshtorch launch`` the launcher's, under torchrun its
    ``TORCHELASTIC_RUN_ID`` (every rank must agree on the run directory).

    Raises:
        UsageError: naming ``--run-name``, in a multi-process job that gives no shared name (when ``shared``:
            the name picks the directory every rank writes).
    """
    name = os.environ.get("MESHTORCH_RUN_NAME")
    if not name and shared and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        name = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if name in ("", "none"):
            raise UsageError("--run-name: under torchrun every process must write the same run directory; give "
                             "--run-name (or --checkpoint-dir), or start the job with meshtorch launch.")
        name = _SAFE.sub("_", name)
    return name or time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def check_run_name(flag: str, name: str) -> str:
    """``name`` if it is a usable directory name (letters, digits, ``_ . -``; not ``latest``), else UsageError."""
    if not _NAME_RE.match(name) or name == LATEST:
        raise UsageError(f"{flag} {name!r} is not a usable run name; use letters, digits, '_', '.' and '-' "
                         f"(and not {LATEST!r}).")
    return name


def read_latest(runs_dir: str) -> str | None:
    """The run name ``<runs_dir>/latest`` points at, or None if there is no such pointer."""
    p = os.path.join(runs_dir, LATEST)
    if os.path.islink(p):
        return os.path.basename(os.path.normpath(os.readlink(p)))
    if os.path.isfile(p):
        with open(p) as f:
            return f.read().strip() or None
    return None


def point_latest(runs_dir: str, name: str) -> None:
    """Make ``<runs_dir>/latest`` point at run ``name`` (a relative symlink, replaced atomically; a text
    file holding the name where symlinks are not available)."""
    os.makedirs(runs_dir, exist_ok=True)
    p = os.path.join(runs_dir, LATEST)
    tmp = os.path.join(runs_dir, f".{LATEST}-{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(name, tmp)
    except OSError:
        with open(tmp, "w") as f:
            f.write(name + "\n")
    if os.path.isdir(p) and not os.path.islink(p):
        raise UsageError(f"--runs-dir: {p!r} is a directory; remove it (meshtorch keeps a pointer named "
                         f"{LATEST!r} there).")
    os.replace(tmp, p)


def resolve_run(args) -> RunPaths:
    """The run's name and paths from ``--runs-dir``, ``--run-name``, ``--checkpoint-dir``, ``--plot``,
    ``--resume`` and ``--resume-from`` (None = default for the last four).

    ``--resume`` without ``--run-name`` or ``--checkpoint-dir`` continues the run ``latest`` points at;
    ``--resume-from DIR/ckpt-<step>`` keeps saving in ``DIR`` unless ``--checkpoint-dir`` says otherwise.

    Raises:
        UsageError: naming ``--resume`` when there is no run to resume, or ``--run-name`` when the name is
            not a usable directory name.
    """
    runs_dir = args.runs_dir
    name = args.run_name
    if name is not None:
        check_run_name("--run-name", name)
    explicit = args.checkpoint_dir is not None
    resume_from = getattr(args, "resume_from", None)
    if args.resume and name is None and not explicit and not resume_from:
        name = read_latest(runs_dir)
        if name is None:
            raise UsageError(f"--resume: nothing to resume: there is no earlier run in {runs_dir!r} "
                             f"({os.path.join(runs_dir, LATEST)!r} does not exist); drop --resume to start a new "
                             "run, or name one with --run-name / --checkpoint-dir.")
    if name is None:
        name = default_run_name(shared=not explicit and not resume_from)
        if not os.environ.get("MESHTORCH_RUN_NAME") and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            base, k = name, 1
            while os.path.lexists(os.path.join(runs_dir, name)):  # two runs started within one second
                name, k = f"{base}-{k}", k + 1
    run_dir = os.path.join(runs_dir, name)
    if explicit:
        ckpt = args.checkpoint_dir
    elif resume_from:
        ckpt = os.path.dirname(os.path.normpath(resume_from))
    else:
        ckpt = os.path.join(run_dir, "ckpt")
    plot = args.plot if args.plot is not None else os.path.join(run_dir, "loss.png")
    return RunPaths(name, run_dir, ckpt, plot, not explicit and not resume_from)


def nothing_to_resume(flag: str, checkpoint_dir: str) -> UsageError:
    """The one-line error of a ``--resume`` that finds no checkpoint."""
    return UsageError(f"{flag}: nothing to resume: {checkpoint_dir!r} holds no complete checkpoint (ckpt-<step> with "
                      "a manifest.json); drop --resume to start a new run.")


def data_fingerprint(docs: list[str]) -> str:
    """SHA-256 (hex, first 16 digits) of the training documents, in order: identifies the corpus a
    checkpoint's data position refers to."""
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def run_record(paths: RunPaths, args, cfg: dict, fingerprint: str, n_docs: int) -> dict:
    """What identifies a run (written as ``run.json`` beside its checkpoints and into each checkpoint's
    ``extra``): name, model config, data fingerprint, tokenizer, mesh, layout, storage, meshtorch version."""
    return {"run": paths.name, "config": cfg, "data_fingerprint": fingerprint,
            "data_files": {"files": list(args.data or []) or "built-in corpus", "documents": n_docs},
            "tokenizer": args.tokenizer, "mesh": args.mesh, "layout": args.layout,
            "storage": getattr(args, "storage", "") or "", "processes": int(os.environ.get("WORLD_SIZE", "1")),
            "meshtorch_version": __version__}


def write_run_manifest(checkpoint_dir: str, record: dict) -> str:
    """Write ``record`` to ``<checkpoint_dir>/run.json``; returns the path."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, RUN_MANIFEST)
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**record, "time": time.time()}, f, indent=1)
    os.replace(tmp, path)
    return path


def resume_mismatch(saved: dict, record: dict) -> tuple[str, str] | None:
    """The first difference between a checkpoint's ``extra`` and this run's :func:`run_record` that forbids
    resuming: ``(kind, message)`` with kind ``"config"`` or ``"data"``, or None when they agree.

    Model config fields (but ``vocab_multiple``, which follows the layout, and the pipeline fields: stacked and
    per-layer checkpoints restore into each other) and the tokenizer must be equal;
    a checkpoint written before fingerprints were recorded is not checked for data.
    """
    old_cfg, new_cfg = saved.get("config") or {}, record["config"]
    for k in new_cfg:
        if k in _LAYOUT_FIELDS or k not in old_cfg or old_cfg[k] == new_cfg[k]:
            continue
        flag = _FLAG.get(k, "the model flags")
        return "config", (f"model config field {k!r} differs: the checkpoint has {old_cfg[k]!r}, this run "
                          f"{new_cfg[k]!r} ({flag}); give the checkpoint's value, or start a new run without --resume")
    if saved.get("tokenizer", record["tokenizer"]) != record["tokenizer"]:
        return "config", (f"--tokenizer differs: the checkpoint used {saved['tokenizer']!r}, this run "
                          f"{record['tokenizer']!r}")
    old = saved.get("data_fingerprint")
    if old is not None and old != record["data_fingerprint"]:
        return "data", (f"the training data (--data) differ: data fingerprint {old} in the checkpoint, "
                        f"{record['data_fingerprint']} now; pass --force-data to continue on the new data from "
                        "its start")
    return None


def resume_changes(saved: dict, record: dict) -> str:
    """What changed between a checkpoint's run and this resuming run among what may change (mesh, layout,
    storage, number of processes, pipeline fields), as ``"; mesh 'data:4' -> 'data:2', processes 4 -> 2"`` ('' if
    nothing did)."""
    changed = [f"{k} {saved.get(k)!r} -> {record.get(k)!r}" if k != "processes" else
               f"processes {saved.get(k)} -> {record.get(k)}"
               for k in ("mesh", "layout", "storage", "processes")
               if k in saved and (saved.get(k) or "") != (record.get(k) or "")]
    old_cfg, new_cfg = saved.get("config") or {}, record.get("config") or {}
    changed += [f"{k} {old_cfg[k]} -> {new_cfg[k]}" for k in _PIPELINE_FIELDS
                if k in old_cfg and k in new_cfg and old_cfg[k] != new_cfg[k]]
    return "; " + ", ".join(changed) if changed else ""


def check_paths(paths: RunPaths, resuming: bool) -> None:
    """The output directories are writable (UsageError naming ``--checkpoint-dir`` / ``--plot``), and a new
    run (not ``resuming``) does not write into a checkpoint directory holding another run's checkpoints
    (UsageError naming ``--checkpoint-dir`` and the newest of them)."""
    newest = latest_checkpoint(paths.checkpoint_dir) if paths.checkpoint_dir and not resuming else None
    if newest:
        raise UsageError(f"--checkpoint-dir {paths.checkpoint_dir!r} already holds checkpoints of an earlier run "
                         f"(newest: {os.path.basename(newest)}); a new run there would mix with them: give --resume "
                         "to continue that run, or another --checkpoint-dir (or none: each run gets its own "
                         "directory under --runs-dir).")
    for d in (paths.checkpoint_dir, os.path.dirname(paths.plot) if paths.plot else ""):
        _note_missing(d)
    checks.writable_dir("--checkpoint-dir", paths.checkpoint_dir)
    checks.writable_file("--plot", paths.plot)


#: directories this process created to check they are writable (removed again if a refused run leaves them empty)
_CREATED: list[str] = []


def _note_missing(path: str) -> None:
    """Remember ``path`` and its missing ancestors (outermost first) before they are created."""
    missing, p = [], os.path.abspath(path) if path else ""
    while p and not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    _CREATED.extend(reversed(missing))


def remove_new_empty_dirs(remove: bool = True) -> None:
    """Remove the directories :func:`check_paths` created that are still empty (innermost first): called when a
    command fails, so a refused run leaves no empty ``runs/<name>/ckpt`` behind (``remove=False``: forget them)."""
    for d in reversed(_CREATED if remove else []):
        try:
            os.rmdir(d)
        except OSError:
            pass
    _CREATED.clear()
