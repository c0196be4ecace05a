"""`python -m stabletune_core.query_cli scan|validate|memory|demo-assets`: engine answers for a torch-free UI.

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

from .config import ConfigError, add_config_arguments


def scan(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset as a run with these settings (TrainConfig flags: --resolution, --bucket-step, ...) would see it."""
    from .config import config_from_args
    from .data import DatasetError, scan_dataset
    from .data.buckets import assign_bucket, training_buckets

    config = config_from_args(args)
    try:
        result = scan_dataset(Path(config.train_data_dir), default_caption=config.default_caption,
                              caption_extension=config.caption_extension)
    except DatasetError as exc:
        return {"error": str(exc)}
    buckets = training_buckets(config)
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
    if not problems and config.model_family == "auto":  # the knobs of the family the checkpoint says it is
        from .config.families import family_problems
        from .models.loading import family_name

        problems = family_problems(config, family_name(config))
    if not problems and args.write:  # the UI's form on a host without pydantic 2 (launch.write_run_config)
        config.save_form_toml(args.write)
    return {"problems": problems, "config": config.model_dump(mode="json"), "notes": config.notes()}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Values (JSON on stdin, the UI's form: every knob) -> the memory plan the run would make, in the sentence it
    prints ({"plan"}: for vram_gb, or without it for this machine's GPU as measured now; None on a CPU), the estimate
    of the settings as they stand ({"memory", "gib"}) and what each memory choice needs ({"costs"}); all None for a
    family without a memory model (SD 1.x / 2.x) or a Klein whose size cannot be read."""
    from .config import build_config
    from .family_files import is_flux2_klein
    from .models.loading import family_name

    form = build_config(json.load(sys.stdin))
    # the form sends every knob: those at their default are left to the plan, as in the run's config.toml
    config = build_config({k: v for k, v in form.model_dump(mode="json").items()
                           if v is not None and k not in form.left_to_the_plan()})
    family = family_name(config) if config.pretrained_model_name_or_path or config.model_family != "auto" else "auto"
    from .models.memory_plan import (FAMILY_MEMORY_MODELS, choice_costs, free_device_bytes, measured_budget,
                                     memory_sentence, plan_memory)

    nothing = {"memory": None, "gib": None, "plan": None, "costs": None}
    if family not in FAMILY_MEMORY_MODELS:
        return nothing
    from .models.flux2_klein.memory import UnknownSize, config_memory_sentence
    from .models.memory import GIB

    if is_flux2_klein(family):
        try:  # no number for a Klein of unknown size (the run plans it as a 4B and says so)
            config_memory_sentence(config)
        except UnknownSize as exc:
            return {**nothing, "memory": str(exc)}
    sentence, estimate = memory_sentence(config, family)
    measured = None if config.vram_gb else measured_budget(free_device_bytes())
    try:
        plan = plan_memory(config, measured, family) if config.vram_gb or measured is not None else None
    except ConfigError as exc:  # vram_gb below anything that fits: the run's one sentence
        return {"memory": sentence, "gib": round(estimate.peak / GIB, 2), "plan": exc.problems[0],
                "costs": choice_costs(config, family)}
    planned = config.model_copy(update=plan.update) if plan else config
    return {"memory": sentence, "gib": round(estimate.peak / GIB, 2), "plan": plan.sentence if plan else None,
            "costs": choice_costs(planned, family)}


def demo_assets(args: argparse.Namespace) -> dict[str, Any]:
    """Paths of the demo's tiny model and drawn dataset (built into the cache the first time)."""
    from .demo import demo_assets as build

    model, data = build(args.concept, args.family)
    return {"pretrained_model_name_or_path": str(model), "train_data_dir": str(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stabletune_core.query_cli", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    s = commands.add_parser("scan", help="Scan a dataset folder: usable images, skipped files, buckets (takes the "
                            "train flags that shape them, e.g. --resolution; the rest keep their defaults).")
    s.add_argument("--data", dest="train_data_dir", required=True, help="The dataset folder (train_data_dir).")
    add_config_arguments(s)
    s.set_defaults(handler=scan)

    v = commands.add_parser("validate", help="Validate config values given as JSON on stdin.")
    v.add_argument("--write", help="Write the resolved config.toml here when it is valid.")
    v.set_defaults(handler=validate)

    m = commands.add_parser("memory", help="The memory plan and estimate of a FLUX.2 Klein or SDXL run from config "
                            "values given as JSON on stdin (models/memory_plan.py); null for other families.")
    m.set_defaults(handler=memory)

    d = commands.add_parser("demo-assets", help="Build (once) and print the demo model and dataset paths.")
    d.add_argument("--family", required=True, help="Whose toy base: sd1, flux2_klein or z_image.")
    d.add_argument("--concept", required=True, help="What the demo learns: colour or shape.")
    d.set_defaults(handler=demo_assets)

    args = parser.parse_args(argv)
    try:
        answer = args.handler(args)
    except ConfigError as exc:  # bad values: the UI shows the sentences
        answer = {"error": " ".join(exc.problems)}
    except Exception as exc:  # a bug: one sentence for the UI, the traceback kept in a file it names
        from .train.outcome import save_traceback

        where = save_traceback(exc, None)
        answer = {"error": f"internal error: {type(exc).__name__}: {exc}; the traceback is in {where}."}
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    raise SystemExit(main())
