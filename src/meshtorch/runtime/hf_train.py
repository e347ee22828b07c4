"""``meshtorch train --init-from DIR``: what differs when the model is a Hugging Face GPT-2 / Llama directory
instead of a native preset. Only the model source differs (flags that cannot apply, the model config, the
tokenizer, the weights); the training loop is :func:`meshtorch.runtime.train.main_train`'s, the same for both.

- :func:`refuse_flags`: the ``meshtorch train`` flags that cannot apply to an imported model, refused by
  name before anything is loaded (nothing is silently ignored).
- :func:`model_config`: the model's :class:`~meshtorch.models.hf_config.HFModelConfig` with the run's batch,
  length, padded vocabulary and ``--remat``, from ``DIR/config.json`` (or, on ``--resume``, from the run's
  record).
- :func:`tokenizer`: ``DIR/tokenizer.json`` (copied beside the run's checkpoints), UTF-8 bytes only with an
  explicit ``--tokenizer byte``.
- :func:`check_prompt`: a prompt the tokenizer cannot encode (unknown characters) or that fills the context.
"""

from __future__ import annotations

import os
import shutil

from meshtorch.checkpoint import hf
from meshtorch.core.errors import UsageError
from meshtorch.data.hf_tokenizer import HFTokenizer
from meshtorch.data.pairs import read_pairs
from meshtorch.data.text import ByteTokenizer
from meshtorch.models.hf_config import HFModelConfig
from meshtorch.models.hf_families import parse_hf_config

#: the model's tokenizer file in DIR (and beside the run's checkpoints); also ``TrainConfig.tokenizer`` (and
#: run.json's ``tokenizer``) of a run tokenized with it
TOKENIZER = "tokenizer.json"
DEFAULT_BATCH, MAX_DEFAULT_LENGTH = 8, 128

#: flags (TrainConfig fields) that cannot apply to an imported model, and why
_REFUSED = {"preset": "the model is the one in DIR", "layers": "its sizes come from DIR/config.json",
            "d_model": "its sizes come from DIR/config.json", "heads": "its sizes come from DIR/config.json",
            "d_kv": "its sizes come from DIR/config.json", "d_ff": "its sizes come from DIR/config.json",
            "experts": "an imported model has no mixture-of-experts layers",
            "activation": "its activation comes from DIR/config.json", "gated": "its MLP comes from DIR/config.json",
            "norm": "its normalization comes from DIR/config.json",
            "dropout": "the imported graph has no dropout",
            "vocab_size": "it sizes a SentencePiece vocabulary; the model's tokenizer.json has its own"}


def refuse_flags(cfg) -> None:
    """Refuse, by name, every flag of ``cfg`` (a :class:`~meshtorch.runtime.train_config.TrainConfig` with
    ``init_from``) that cannot apply to an imported model.

    Raises:
        UsageError: naming the flag and ``--init-from``.
    """
    for field, why in _REFUSED.items():
        value = getattr(cfg, field)
        if value is not None and value is not False:
            raise UsageError(f"--{field.replace('_', '-')} cannot be combined with --init-from: {why}.")
    if cfg.tokenizer == "sentencepiece":
        raise UsageError("--tokenizer sentencepiece cannot be combined with --init-from: the model's own "
                         f"{TOKENIZER} tokenizes the data (or --tokenizer byte for UTF-8 bytes).")


def check_layout_search(cfg, model: HFModelConfig) -> None:
    """``--layout auto`` / ``--storage auto`` with ``--init-from``: refused for T5 (the search ranks decoder-only
    graphs: its memory and cost plans and the measured candidates' steps are the LM's).

    Raises:
        UsageError: naming the flag, T5 and what to give instead.
    """
    for flag, value in (("--layout", cfg.layout), ("--storage", cfg.storage)):
        if value == "auto" and model.encoder_decoder:
            raise UsageError(f"{flag} auto cannot be combined with --init-from a T5 directory: the layout search "
                             f"ranks decoder-only models; give {flag} rules, e.g. batch:data;heads:model;d_ff:model;"
                             "vocab:model.")


def model_config(cfg, vocab_multiple: int, saved: dict | None = None) -> HFModelConfig:
    """The imported model's config for a run of ``cfg``: ``--init-from``'s ``config.json`` (or the resumed run's
    recorded ``hf_config`` in ``saved``), with ``--batch-size`` (default 8), ``--length`` (default the model's
    positions, at most 128), ``--remat`` and the vocabulary padded to ``vocab_multiple``.

    Raises:
        CheckpointError: the model directory (:func:`meshtorch.checkpoint.hf.read_config`, :func:`~meshtorch.
            checkpoint.hf.check_files`). UsageError: ``--length`` past the model's positions.
    """
    if saved and "hf_config" in saved:
        c = parse_hf_config(saved["hf_config"], where=f"the run's {saved.get('run')!r} record")
    else:
        c = hf.read_config(cfg.init_from)
        hf.check_files(cfg.init_from, c)
    length = cfg.length or min(c.max_positions, MAX_DEFAULT_LENGTH)
    try:
        c = c.with_shape(cfg.batch_size or DEFAULT_BATCH, length)
    except ValueError as e:
        raise UsageError(f"--length: {e}") from None
    pipe = cfg.pipeline_fields() if (cfg.pipeline_stages or 0) > 1 else {}
    return c.replace(vocab_multiple=vocab_multiple, remat=cfg.remat or "none", **pipe)


def check_pipeline(cfg, model: HFModelConfig, world: int) -> None:
    """A pipeline layout (``stage:<axis>``, resolved into ``cfg.pipeline_stages`` > 1) for imported ``model``: T5
    runs the pipeline layout's own program only (``--pipeline-schedule gpipe``, its encoder's then its decoder's
    blocks over the stages: :func:`meshtorch.models.hf_t5.build_t5`), with as many decoder as encoder blocks per
    stage; a tied head is refused under ``--pipeline-schedule 1f1b`` etc. on torchrun ranks (the first and last
    stages' processes would each update their own copy of the shared embedding); ``world``: torchrun's process
    count.

    Raises:
        UsageError: naming ``--layout`` (or ``--pipeline-stages``) / ``--pipeline-schedule`` and ``--init-from``.
    """
    if (cfg.pipeline_stages or 0) <= 1:
        return
    if model.encoder_decoder:
        if cfg.pipeline_schedule not in (None, "gpipe"):
            raise UsageError(f"--pipeline-schedule {cfg.pipeline_schedule} cannot be combined with --init-from a T5 "
                             "directory: the stage executor cuts decoder-only models only; use --pipeline-schedule "
                             "gpipe (the pipeline layout's program, the default).")
        S, R = cfg.pipeline_stages, cfg.pipeline_repeats or 1
        if model.num_decoder_layers != S * R:
            raise UsageError(f"--layout {cfg.layout!r}: a {S}-stage pipeline x {R} repeats runs {S * R} encoder "
                             f"and {S * R} decoder blocks, but {cfg.init_from}/config.json has num_decoder_layers "
                             f"{model.num_decoder_layers}; use stages x --pipeline-repeats = both block counts, or "
                             "no 'stage' rule.")
    if model.tied and cfg.pipeline_schedule not in (None, "gpipe") and world > 1:
        raise UsageError(f"--pipeline-schedule {cfg.pipeline_schedule} cannot be combined with --init-from a model "
                         "with tied embeddings under torchrun (its first and last stages' processes would update "
                         "the shared embedding apart); use --pipeline-schedule gpipe, or one process.")


def t5_pairs(cfg):
    """A T5 run's ``(input, target, file:line)`` pairs from ``--data`` (:func:`meshtorch.data.pairs.read_pairs`),
    or None when ``cfg`` is not ``--init-from`` a T5 directory (nor the resume of a T5 run).

    Raises:
        UsageError: a T5 run (or its ``--resume``, naming the run's files) without ``--data``, or with a flag T5
            training does not support. CheckpointError: the directory's config.json. DataError: the pairs file.
    """
    if not cfg.init_from:
        return None
    saved = cfg.saved_record()
    c = (parse_hf_config(saved["hf_config"], where="the run's record") if saved and "hf_config" in saved
         else hf.read_config(cfg.init_from))
    if not c.encoder_decoder:
        return None
    if not cfg.data and saved:  # --resume: name the files the run trained on (run.json's data_files)
        files = (saved.get("data_files") or {}).get("files") or []
        raise UsageError(f"--resume of the T5 run {saved.get('run')!r} needs --data: give its 'input<TAB>target' "
                         f"file(s) again ({' '.join(files) if isinstance(files, list) else files}, in its run.json).")
    if not cfg.data:
        raise UsageError("--init-from a T5 directory needs --data FILE of 'input<TAB>target' lines "
                         "(docs/huggingface.md).")
    for flag, bad in (("--accumulate", cfg.accumulate > 1), ("--precision", cfg.precision_policy.mixed)):
        if bad:
            raise UsageError(f"{flag} cannot be combined with --init-from a T5 directory: T5 fine-tuning runs in "
                             "float32, one batch per step.")
    return read_pairs(cfg.data)


def tokenizer(cfg, model: HFModelConfig):
    """The run's tokenizer: the model's ``tokenizer.json`` (from ``--init-from``, or, on ``--resume``, the copy
    beside the run's checkpoints), or UTF-8 bytes with ``--tokenizer byte``.

    Raises:
        UsageError: naming ``--init-from`` and the file: no tokenizer.json without ``--tokenizer byte``; a
            tokenizer (or the 256 bytes) with more ids than the model's vocabulary.
    """
    if cfg.tokenizer == "byte":
        if model.vocab_size < 256:
            raise UsageError(f"--tokenizer byte: the model's vocabulary ({model.vocab_size}) is smaller than the 256 "
                             "UTF-8 byte values.")
        return ByteTokenizer()
    dirs = [d for d in (cfg.init_from, cfg.checkpoint_dir if cfg.resuming else None) if d]
    for d in dirs:
        path = os.path.join(d, TOKENIZER)
        if os.path.isfile(path):
            tok = HFTokenizer(path)
            if tok.vocab_size > model.vocab_size:
                raise UsageError(f"--init-from: {path!r} has {tok.vocab_size} tokens but the model's vocab_size is "
                                 f"{model.vocab_size}.")
            return tok
    raise UsageError(f"--init-from: {os.path.join(dirs[0], TOKENIZER)!r} does not exist; the model's tokenizer is "
                     "needed to give its token ids (copy it there), or give --tokenizer byte to train on UTF-8 bytes.")


def check_prompt(tok, prompt: str, length: int, flag: str = "--prompt") -> list[int]:
    """``tok``'s ids of ``prompt``, checked: every character encodable (no unknown token) and room left in the
    context of ``length`` tokens.

    Raises:
        UsageError: naming ``flag`` and the characters the tokenizer does not know, or the prompt's length.
    """
    bad = tok.unknown_characters(prompt) if hasattr(tok, "unknown_characters") else []
    if bad:
        raise UsageError(f"{flag}: the tokenizer {getattr(tok, 'path', '')!r} has no token for "
                         f"{', '.join(repr(ch) for ch in bad)} (they would become its unknown token); remove "
                         "or replace them.")
    ids = tok.encode(prompt)
    if len(ids) == 0 or len(ids) >= length:
        raise UsageError(f"{flag} is {len(ids)} tokens; the model's context is {length} tokens, so give 1 to "
                         f"{length - 1} (or a longer --length).")
    return ids


def save_tokenizer(tok, checkpoint_dir: str) -> None:
    """Copy the run's ``tokenizer.json`` beside its checkpoints (``meshtorch sample`` / ``export`` read it)."""
    if checkpoint_dir and isinstance(tok, HFTokenizer):
        os.makedirs(checkpoint_dir, exist_ok=True)
        dest = os.path.join(checkpoint_dir, TOKENIZER)
        if os.path.abspath(tok.path) != os.path.abspath(dest):
            shutil.copyfile(tok.path, dest)


def record_fields(cfg, model: HFModelConfig) -> dict:
    """What run.json records of an imported model beside the config: the source directory and its config.json."""
    return {"init_from": os.path.abspath(cfg.init_from) if cfg.init_from else None, "hf_config": model.hf_config}


__all__ = ["TOKENIZER", "check_pipeline", "check_prompt", "model_config", "record_fields", "refuse_flags",
           "save_tokenizer", "t5_pairs", "tokenizer"]

