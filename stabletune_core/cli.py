"""`python -m stabletune_core train|preflight|demo|export|inspect|resize|schema`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import ConfigError, TrainConfig, add_config_arguments, build_config, config_from_args, read_toml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stabletune_core", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="Train a LoRA (every TrainConfig field is a flag).")
    add_config_arguments(train)

    preflight = commands.add_parser("preflight", help="One step at the largest bucket and one sampling pass: "
                                    "peak memory and the largest micro-batch that fits (takes the train flags).")
    add_config_arguments(preflight)

    demo = commands.add_parser("demo", help="Train a tiny model on drawn shapes: a full run, no download.")
    demo.add_argument("--output_dir", "--output-dir", default="runs/demo", help="Run directory of the demo.")
    demo.add_argument("--max_train_steps", "--max-train-steps", type=int, default=None)
    demo.add_argument("--resume", action="store_true", help="Continue the demo run in --output_dir.")

    export = commands.add_parser("export", help="Write the LoRA of a checkpoint (kohya/A1111 format).")
    export.add_argument("checkpoint", help="A checkpoint folder RUN/checkpoints/step_NNNNNN.")
    export.add_argument("--name", default=None, help="Output name (default: the run's output_name + step).")

    inspect = commands.add_parser("inspect", help="Describe a LoRA file or a run directory.")
    inspect.add_argument("path")

    resize = commands.add_parser("resize", help="Lower a LoRA file's rank by SVD; writes NAME-rN.safetensors "
                                 "beside it (the input is never changed).")
    resize.add_argument("lora", help="A kohya/A1111 LoRA .safetensors file.")
    resize.add_argument("--rank", type=int, default=None, help="New rank of every module (at most the current).")
    resize.add_argument("--energy", type=float, default=None,
                        help="Per module, the smallest rank keeping this fraction of ||dW||^2 (e.g. 0.95); "
                        "with --rank, that rank is the ceiling.")

    schema = commands.add_parser("schema", help="Print the TrainConfig JSON schema (for UIs).")
    schema.set_defaults()

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return run_train(config_from_args(args))
        if args.command == "preflight":
            return run_preflight(config_from_args(args))
        if args.command == "demo":
            return run_demo(args)
        if args.command == "export":
            return run_export(Path(args.checkpoint), args.name)
        if args.command == "inspect":
            return run_inspect(Path(args.path))
        if args.command == "resize":
            return run_resize(Path(args.lora), args.rank, args.energy)
        if args.command == "schema":
            print(json.dumps(TrainConfig.model_json_schema(), indent=1))
            return 0
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    return 1


def run_train(config: TrainConfig) -> int:
    from .train.loop import train  # torch loads only when there is something to train

    from .train.guards import OutOfMemoryStop

    for note in config.notes():
        print(f"note: {note}", file=sys.stderr)
    try:
        path = train(config)
    except OutOfMemoryStop as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if path:
        print(f"LoRA written to {path}")
    return 0


def run_preflight(config: TrainConfig) -> int:
    """Preflight in a throw-away run directory, so the real one is never touched."""
    import tempfile

    from .train.loop import setup
    from .train.preflight import describe, preflight

    with tempfile.TemporaryDirectory(prefix="stabletune-preflight-") as folder:
        session = setup(config.model_copy(update={"output_dir": folder, "resume_from_checkpoint": None}))
        print(describe(preflight(session)))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from .demo import demo_config

    config = demo_config(Path(args.output_dir), max_train_steps=args.max_train_steps, resume=args.resume)
    print(f"Demo run in {config.output_dir}: the toy base model, which draws red, yellow, green and cyan shapes, "
          f"learns purple from {config.train_data_dir} ({config.max_train_steps} steps).")
    code = run_train(config)
    if code == 0:
        from .demo import make_gallery

        gallery = make_gallery(Path(config.output_dir))
        if gallery:
            print(f"Before/after gallery (same prompts and seeds at every sampling): {gallery}")
    return code


def run_export(checkpoint: Path, name: str | None) -> int:
    """Rebuild the run's model in a scratch run directory (so the real run's status, config and events stay
    as they are), load the checkpoint, and place the LoRA next to the run's other outputs."""
    import shutil
    import tempfile

    from .train.loop import export, resume, setup

    checkpoint = checkpoint.resolve()
    run_dir = checkpoint.parent.parent
    values = read_toml(run_dir / "config.toml")
    with tempfile.TemporaryDirectory(prefix="stabletune-export-") as scratch:
        config = build_config({**values, "output_dir": scratch, "resume_from_checkpoint": str(checkpoint),
                               "validation_prompt": "", "perceptual_lambda": 0.0, "early_stopping": False})
        session = setup(config)
        resume(session)
        name = name or f"{config.output_name}_step{session.state.step:06d}"
        target = run_dir / "output" / f"{name}.safetensors"
        if target.exists():
            raise ConfigError([f"{target} already exists; pass --name to write the LoRA under another name."])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(export(session, name)), target)
    print(f"LoRA written to {target}")
    return 0


def run_resize(path: Path, rank: int | None, energy: float | None) -> int:
    from .lora.resize import ResizeError, report_table, resize_file

    try:
        target, report = resize_file(path, rank=rank, energy=energy)
    except ResizeError as exc:
        raise ConfigError([str(exc)]) from None
    print(report_table(report))
    print(f"Resized LoRA written to {target}")
    return 0


def run_inspect(path: Path) -> int:
    if path.is_dir():
        from .runs.reader import RunReader

        reader = RunReader(path)
        print(json.dumps(reader.status(), indent=1))
        print(f"{len(reader.metrics())} metric lines, {len(reader.events())} events, "
              f"{len(reader.checkpoints())} checkpoints, LoRAs: {[p.name for p in reader.loras()]}")
        return 0
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
        keys = list(f.keys())
    modules = {k.rsplit(".", 2)[0] for k in keys}
    print(f"{path.name}: {len(keys)} tensors, {len(modules)} LoRA modules")
    for key in sorted(metadata):
        value = metadata[key]
        print(f"  {key} = {value if len(value) < 120 else value[:117] + '...'}")
    return 0
