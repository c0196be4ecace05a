"""`python -m stabletune_core.toy build|score`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stabletune_core.toy")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="Train the toy base model (about 20 minutes on 2 idle CPU cores).")
    build.add_argument("--out", type=Path, default=None, help="Folder for the weights (default: the shipped one).")
    build.add_argument("--vae-steps", type=int, default=None,
                       help="Codec steps (default: each family's recipe, 600 for sd1, 1500 for flux2_klein and "
                            "z_image).")
    build.add_argument("--vae-polish-steps", type=int, default=300, help="Decoder-only polish steps (sd1).")
    build.add_argument("--unet-steps", "--transformer-steps", type=int, default=None,
                       help="Denoiser steps (default: each family's recipe, 3200 for sd1, 10000 for flux2_klein, "
                            "8500 for z_image).")
    build.add_argument("--family", default="sd1", help="Which toy base: 'sd1' (SD 1.x), 'flux2_klein' or 'z_image'.")
    score = commands.add_parser("score", help="Score a toy-base model folder (and optionally a LoRA on it).")
    score.add_argument("model", type=Path, nargs="?", default=None)
    score.add_argument("--lora", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.command == "build":
        from .bases import TOY_BASES, BuildSteps, unknown_family_sentence

        problem = unknown_family_sentence(args.family)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        # only what the user gave: each family's build() holds its own recipe's defaults
        steps = BuildSteps(args.vae_steps, args.unet_steps, args.vae_polish_steps)
        TOY_BASES[args.family].build(args.out, steps, lambda m: print(m, flush=True))
        return 0
    from . import load_toy_pipeline, toy_base_model
    from .evaluate import base_report

    pipe = load_toy_pipeline(args.model or toy_base_model())
    if args.lora:
        pipe.load_lora_weights(str(args.lora.parent), weight_name=args.lora.name)
    print(json.dumps(base_report(pipe), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
