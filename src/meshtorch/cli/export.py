"""``meshtorch export``: the argument parser (writing a Hugging Face directory: :mod:`meshtorch.runtime.hf_jobs`)."""

from __future__ import annotations

from meshtorch.cli._help import HelpFormatter
from meshtorch.runtime.hf_jobs import main_export


def add_export_subcommand(subparsers) -> None:
    """Register ``meshtorch export`` on an argparse sub-parsers object."""
    p = subparsers.add_parser("export", help="write a fine-tuned Hugging Face model (config.json + safetensors)",
                              formatter_class=HelpFormatter)
    p.add_argument("--checkpoint-dir", required=True,
                   help="the --checkpoint-dir of a 'meshtorch train' run (its newest checkpoint) or one ckpt-<step> "
                        "directory: a --init-from run exports to its own family; a native run exports as GPT-2 when "
                        "trained with --norm layer and an ungated feed-forward (else refused, naming why)")
    p.add_argument("--hf", required=True, metavar="OUT",
                   help="output directory (new or empty): config.json, safetensors, tokenizer.json; loads with "
                        "transformers.AutoModelForCausalLM.from_pretrained(OUT)")
    p.add_argument("--max-shard-mb", type=float, default=5120.0,
                   help="largest safetensors file in MiB; above it the model is sharded with an index file")
    p.add_argument("--mesh", default="", help="mesh to restore on (default: 1 processor)")
    p.add_argument("--layout", default="", help="layout rules tensor_dim:mesh_axis;... (default: replicated)")
    p.add_argument("--storage", default="", help='storage layout rules, e.g. "d_model:data"')
    p.set_defaults(func=main_export)


add_parser = add_export_subcommand  # the cli's module protocol
