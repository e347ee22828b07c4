"""``meshtorch sample``: the argument parser (decoding from a checkpoint: :mod:`meshtorch.runtime.sample`)."""

from __future__ import annotations

from meshtorch.cli._help import HelpFormatter
from meshtorch.runtime.hf_jobs import run_sample


def add_sample_subcommand(subparsers) -> None:
    """Register ``meshtorch sample`` on an argparse sub-parsers object."""
    p = subparsers.add_parser("sample", help="generate text from a trained LM checkpoint",
                              formatter_class=HelpFormatter)
    p.add_argument("--checkpoint-dir", default=None,
                   help="a --checkpoint-dir of meshtorch train (its newest checkpoint) or one ckpt-<step> directory, "
                        "or a Hugging Face GPT-2 / Llama / Qwen2 / Mistral directory (config.json + safetensors, "
                        "decoded with its tokenizer.json) (default: the checkpoints of the run <runs-dir>/latest "
                        "names)")
    p.add_argument("--runs-dir", default="runs", help="where meshtorch train keeps its runs")
    p.add_argument("--run-name", default=None, help="decode this run's newest checkpoint (default: the latest run)")
    p.add_argument("--prompt", default="The ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate; past the model's context the window slides (the oldest tokens drop)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--beam", type=int, default=0, help="beam width (0: sample)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (at most the batch size)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--mesh", default="", help="mesh to decode on (default: 1 processor)")
    p.add_argument("--layout", default="", help="layout rules tensor_dim:mesh_axis;... (default: replicated)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's own choice; see docs/cli-train.md for measurements)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda (the mesh's processors spread over the visible GPUs) or cuda:<index> (default: cpu)")
    p.add_argument("--no-cache", action="store_true",
                   help="decode without the KV cache: one full forward pass over the context per new token (the "
                        "recompute path; the same tokens, slower; refused for T5, which decodes with the cache only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sample)


add_parser = add_sample_subcommand  # the cli's module protocol
