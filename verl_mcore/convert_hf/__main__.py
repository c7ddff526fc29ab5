"""verl-mcore-convert-hf {hf-to-mcore, mcore-to-hf, verify} ...  (see --help of each)

Also `python -m verl_mcore.convert_hf`, and `python -m tools.convert_hf` from a checkout.
"""
from __future__ import annotations

import argparse
import sys

from verl_mcore.config import ConfigError
from verl_mcore.convert_hf import lora_export
from verl_mcore.convert_hf.convert import convert_hf_to_mcore, convert_mcore_to_hf
from verl_mcore.convert_hf.verify import DEFAULT_TOLERANCE, verify
from verl_mcore.models.hf_config import UnsupportedConfigError
from verl_mcore.models.hub import is_hub_id, local_dir
from verl_mcore.utils.safe_read import BadCheckpointError


def _parse_size(text: str) -> int:
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}
    for unit, mult in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-mcore-convert-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-mcore", help="HF directory -> megatron dist checkpoint")
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)"
                   " or a Hugging Face Hub id org/name (from the HF cache, downloaded when not there)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub id given as --hf (default: main)")
    p.add_argument("--out", required=True, help="output dist checkpoint directory")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="cast weights (default: keep the HF dtype)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest sequence the model will see (only for sliding-window configs; "
                        "recorded in the checkpoint for mcore-to-hf)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF directory (a LoRA "
                                           "run's checkpoint -> peft adapter directory)")
    p.add_argument("--ckpt", required=True,
                   help="dist checkpoint directory, or a trainer checkpoint's step directory "
                        "(RUN/checkpoints/actor/step_N) or its dist/; a LoRA run's checkpoint "
                        "(adapters only) is written as a peft adapter directory "
                        "(adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--merge", action="store_true",
                   help="LoRA checkpoint: write the base model with the adapters merged in "
                        "(W + alpha/r * B.A) instead of the adapter directory")
    p.add_argument("--base", default=None,
                   help="LoRA checkpoint: the base weights, an HF directory or dist checkpoint "
                        "(default: the one the checkpoint's meta.json records); without --merge, "
                        "the adapter's base_model_name_or_path")
    p.add_argument("--hf-template", default=None,
                   help="HF directory to take config.json and tokenizer files from (default: the "
                        "copy in the checkpoint, which hf-to-mcore and the trainer store; for a "
                        "trainer checkpoint without one, the model.path its config.yaml records) "
                        "or a Hugging Face Hub id org/name (from the HF cache, downloaded when "
                        "not there)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub id given as --hf-template (default: main)")
    p.add_argument("--max-shard-size", type=_parse_size, default="5GB",
                   help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("verify", help="compare megatron (dist checkpoint) with transformers logits")
    p.add_argument("--hf", required=True, help="HF model directory or a Hugging Face Hub id org/name (from the HF cache, downloaded when not there)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub id given as --hf (default: main)")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (MoE models); runs tp * pp * ep ranks")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="largest accepted max|diff| / max|HF logit| (fp32)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A Hub id becomes its snapshot directory here, before verify spawns its ranks (which would
    # otherwise each resolve it).
    given = getattr(args, "hf", None) or getattr(args, "hf_template", None)
    if getattr(args, "revision", None) and not is_hub_id(given):
        print(f"error: --revision {args.revision} selects a snapshot of a Hugging Face Hub id, "
              f"but {given} is not one (a local directory has one version)", file=sys.stderr)
        return 2
    try:
        if getattr(args, "hf", None):
            args.hf = local_dir(args.hf, args.revision, "--hf")
        if getattr(args, "hf_template", None):
            args.hf_template = local_dir(args.hf_template, args.revision, "--hf-template")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "hf-to-mcore":
        try:
            out = convert_hf_to_mcore(args.hf, args.out, dtype=args.dtype, force=args.force,
                                      progress=not args.quiet, max_seq_len=args.max_seq_len)
        except (ConfigError, UnsupportedConfigError) as e:  # the input, or an --out over it: named
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0
    if args.command == "mcore-to-hf":
        try:
            out = _mcore_to_hf(args)
        # What to pass, a damaged checkpoint, an --out without --force, a --ckpt that is not
        # there: each message names the path and the flag.
        except (ConfigError, BadCheckpointError, FileExistsError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0

    diff = verify(args.hf, args.ckpt, tp=args.tp, pp=args.pp, ep=args.ep)
    ok = diff["max_rel"] <= args.tolerance
    print(f"verify tp={args.tp} pp={args.pp} ep={args.ep}: max_abs={diff['max_abs']:.3e} "
          f"max_rel={diff['max_rel']:.3e} tolerance={args.tolerance:.1e} -> "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _mcore_to_hf(args) -> str:
    """A full checkpoint -> HF directory; a LoRA one -> peft adapter directory, or with --merge
    the merged HF model."""
    reader, lora = lora_export.open_checkpoint(args.ckpt)
    if lora is None:
        if args.merge or args.base:
            raise ConfigError(f"--ckpt {args.ckpt} holds full weights, no LoRA adapters: "
                              "--merge and --base apply to a LoRA run's checkpoint; drop them")
        return convert_mcore_to_hf(reader.ckpt_dir, args.out, hf_template=args.hf_template,
                                   force=args.force, progress=not args.quiet,
                                   max_shard_bytes=args.max_shard_size, reader=reader)
    if args.merge:
        return lora_export.export_merged(lora, args.out, base=args.base,
                                         hf_template=args.hf_template, force=args.force,
                                         progress=not args.quiet,
                                         max_shard_bytes=args.max_shard_size)
    if args.hf_template:
        raise ConfigError("--hf-template: a peft adapter directory has no config or tokenizer "
                          "files; it gives the merged model's, with --merge")
    return lora_export.export_peft(lora, args.out, base=args.base, force=args.force)


if __name__ == "__main__":  # required: dist_checkpointing and verify start spawn processes
    sys.exit(main())
