"""`python -m stabletune_core.query_cli scan|validate|demo-assets`: engine answers for a torch-free UI.

The UI process never imports torch (and, inside AUTOMATIC1111, may not even have pydantic 2), but the
dataset scan lives next to torch code and validation needs pydantic 2. So the UI asks the engine's Python
with an argv list and reads one JSON object from stdout. Errors are JSON too ({"error": sentence}), so the
UI can show them instead of a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def scan(args: argparse.Namespace) -> dict[str, Any]:
    from .data import DatasetError, make_buckets, scan_dataset
    from .data.buckets import assign_bucket

    try:
        result = scan_dataset(Path(args.data), default_caption=args.default_caption,
                              caption_extension=args.caption_extension)
    except DatasetError as exc:
        return {"error": str(exc)}
    if args.enable_bucket:
        buckets = make_buckets(args.resolution, args.min_bucket_reso, args.max_bucket_reso, args.bucket_step)
    else:
        buckets = [(args.resolution, args.resolution)]
    items = [{"path": str(i.path), "caption": i.caption, "repeats": i.repeats, "width": i.width,
              "height": i.height, "bucket": list(assign_bucket(i.width, i.height, buckets))} for i in result.items]
    return {
        "root": str(result.root),
        "items": items,
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in result.skipped],
        "buckets": [{"bucket": f"{w}x{h}", "images": n} for (w, h), n in result.bucket_counts(buckets).items()],
        "total_with_repeats": result.total_with_repeats,
    }


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Values (JSON on stdin) -> problems, or the resolved config (written to --write when given)."""
    from .config import ConfigError, build_config, check_inputs

    values = json.load(sys.stdin)
    try:
        config = build_config(values)
    except ConfigError as exc:
        # The world too (folders, model, disk) with the bad fields at their defaults: every problem at once.
        bad = {name for name in values if any(p.startswith(name) for p in exc.problems)}
        try:
            rest = check_inputs(build_config({k: v for k, v in values.items() if k not in bad}))
        except ConfigError:
            rest = []
        return {"problems": exc.problems + [p for p in rest if p not in exc.problems], "config": None, "notes": []}
    problems = check_inputs(config)
    if not problems and args.write:
        config.save_toml(args.write)
    return {"problems": problems, "config": config.model_dump(mode="json"), "notes": config.notes()}


def demo_assets(args: argparse.Namespace) -> dict[str, Any]:
    """Paths of the demo's tiny model and drawn dataset (built into the cache the first time)."""
    from .demo import demo_assets as build

    model, data = build()
    return {"pretrained_model_name_or_path": str(model), "train_data_dir": str(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stabletune_core.query_cli", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    s = commands.add_parser("scan", help="Scan a dataset folder: usable images, skipped files, buckets.")
    s.add_argument("--data", required=True)
    s.add_argument("--caption-extension", default=".txt")
    s.add_argument("--default-caption", default="")
    s.add_argument("--resolution", type=int, default=512)
    s.add_argument("--bucket-step", type=int, default=64)
    s.add_argument("--min-bucket-reso", type=int, default=256)
    s.add_argument("--max-bucket-reso", type=int, default=1024)
    s.add_argument("--enable-bucket", action=argparse.BooleanOptionalAction, default=True)
    s.set_defaults(handler=scan)

    v = commands.add_parser("validate", help="Validate config values given as JSON on stdin.")
    v.add_argument("--write", default=None, help="Write the resolved config.toml here when it is valid.")
    v.set_defaults(handler=validate)

    d = commands.add_parser("demo-assets", help="Build (once) and print the demo model and dataset paths.")
    d.set_defaults(handler=demo_assets)

    args = parser.parse_args(argv)
    try:
        answer = args.handler(args)
    except Exception as exc:  # the UI shows the sentence; the traceback would only go to a log nobody reads
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    raise SystemExit(main())
