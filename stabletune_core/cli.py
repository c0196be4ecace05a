"""`python -m stabletune_core train|preflight|demo|export|inspect|resize|schema`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import import_module
from pathlib import Path

from .config import (ConfigError, TrainConfig, add_config_arguments, build_config, check_inputs, config_from_args,
                     read_toml)


#: Commands that live in their own module: each `add_parser(commands)` adds its parser and sets `run_tool`.
COMMAND_MODULES = ("tools.caption", "tools.captions", "tools.doctor", "tools.merge", "tools.extract", "runqueue",
                   "grid")


class ShortErrorParser(argparse.ArgumentParser):
    """A wrong flag gets one line naming it and where to look, not the full usage of 110 flags."""

    command: str = ""  # set by run_command: the help to point at is the command's, not the top level's

    def error(self, message: str) -> None:  # type: ignore[override]
        prog = self.prog if self.prog.endswith(self.command) else f"{self.prog} {self.command}".rstrip()
        print(f"error: {message}; see `{prog} --help` for every flag.", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    try:
        code = run_command(argv)
    except SystemExit as exc:  # argparse: --help (0) or a wrong flag (2)
        code = exc.code if isinstance(exc.code, int) else 1
    _exit_accelerate_quietly(code)
    return code


def run_command(argv: list[str] | None = None) -> int:
    parser = ShortErrorParser(prog="python -m stabletune_core", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ShortErrorParser)

    train = commands.add_parser("train", help="Train a LoRA (every TrainConfig field is a flag).")
    add_config_arguments(train)

    preflight = commands.add_parser("preflight", help="One step at the largest bucket and one sampling pass: "
                                    "peak memory and the largest micro-batch that fits (takes the train flags).")
    add_config_arguments(preflight)

    demo = commands.add_parser("demo", help="Train a tiny model on drawn shapes: a full run, no download.")
    demo.add_argument("--output_dir", "--output-dir", default="runs/demo", help="Run directory of the demo.")
    demo.add_argument("--max_train_steps", "--max-train-steps", type=int, default=None)
    demo.add_argument("--resume", action="store_true", help="Continue the demo run in --output_dir.")
    demo.add_argument("--network_type", "--network-type", "--algo", choices=("lora", "loha", "lokr"), default="lora",
                      help="Adapter kind to train (LoHa and LoKr get the higher learning rates they need).")
    demo.add_argument("--family", "--model_family", "--model-family", default="sd1",
                      help="Which toy base learns: 'sd1' (a tiny SD 1.x), 'flux2_klein' (a tiny FLUX.2 Klein) or "
                      "'z_image' (a tiny Z-Image).")
    demo.add_argument("--concept", default="colour", help="What the toy base learns: 'colour' (purple, which it "
                      "never saw) or 'shape' (rings, which it never drew, in the colours it knows).")
    demo.add_argument("--concept-images", "--concept_images", default=None, metavar="FOLDER",
                      help="Your own concept: a folder of your images of a colour the toy base never saw (captions "
                      "beside them optional); with --concept-word.")
    demo.add_argument("--concept-word", "--concept_word", default=None, metavar="WORD",
                      help="The word your images' colour is called (e.g. 'blue'): the validation prompts and the "
                      "summary use it; with --concept-images.")
    demo.add_argument("--seed", type=int, default=None, help="Training seed (default: the preset's, 7).")

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
    for module in COMMAND_MODULES:
        import_module(f".{module}", __package__).add_parser(commands)

    raw = sys.argv[1:] if argv is None else argv
    ShortErrorParser.command = next((a for a in raw if not a.startswith("-")), "") if raw else ""
    args = parser.parse_args(argv)
    try:
        if getattr(args, "run_tool", None):
            return args.run_tool(args)
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
        if args.command == "train":  # the run directory, when the flags name one, says `failed` too
            from types import SimpleNamespace

            from .train import outcome

            where = SimpleNamespace(output_dir=_raw_output_dir(args), resume_from_checkpoint=None)
            return outcome.report_failure(exc, where.output_dir, may_write_status=bool(where.output_dir) and
                                          outcome.prepare_status_dir(where))
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except Exception as exc:  # every command keeps train's contract: one sentence (a full disk, a permission), or
        from .train import outcome  # one "internal error" line with the traceback in a file; never a traceback

        return outcome.report_failure(exc, None)
    except KeyboardInterrupt:  # train and demo handle their own signals; the other commands write atomically
        print(f"error: {args.command} interrupted; nothing was written.", file=sys.stderr)
        return 130
    return 1


def _raw_output_dir(args: argparse.Namespace) -> str | None:
    """output_dir as typed (or from --config) when the config itself could not be built."""
    if getattr(args, "output_dir", None):
        return str(args.output_dir)
    try:
        return str(read_toml(args.config).get("output_dir") or "") or None if args.config else None
    except ConfigError:
        return None


def run_train(config: TrainConfig) -> int:
    """Train, and end in a known state: finished (0), stopped by a signal (128 + signal), or failed with one
    sentence on stderr and in status.json (non-zero, see train/outcome.py). Never a traceback."""
    from .runs import lock
    from .train import outcome, signals

    for note in config.notes():
        print(f"note: {note}", file=sys.stderr)
    stop = signals.StopSignals(on_second=lambda signum: _quit_now(config, signum))
    signals.ACTIVE = stop.install()
    try:
        problems = check_inputs(config)  # bad input answers in a second, before torch is even imported
        if problems:
            raise ConfigError(problems)
        lock.hold(config.output_dir)  # one live trainer per run folder; a second start is refused, naming it
        from .train.loop import train  # torch loads only when there is something to train

        path = train(config)
    except BaseException as exc:  # every way out of a run ends in a known state
        if isinstance(exc, SystemExit):
            raise
        if isinstance(exc, KeyboardInterrupt):  # only when our handler was not installed (e.g. a thread)
            exc = outcome.RunFailed("Interrupted before the run could save; continue it with --resume auto.")
        return outcome.report_failure(exc, config.output_dir, may_write_status=outcome.prepare_status_dir(config))
    finally:
        stop.restore()
        signals.ACTIVE = None
        lock.release(config.output_dir)
    if path:
        print(f"LoRA written to {path}")
        for limit in _host_limits(config):  # the run's last lines: where this file does not load
            print(f"host: {limit}")
        for line in _word_lines(config, Path(path)):  # and how each host loads pivotal tuning's words
            print(f"words: {line}")
    return stop.exit_code


def _word_lines(config: TrainConfig, lora: Path) -> list[str]:
    """lora/pivotal.py's word_loading_lines for a run with pivotal tokens (none without)."""
    if not config.pivotal_tokens:
        return []
    from .config.tokens import parse_tokens
    from .lora.pivotal import word_loading_lines
    from .models import get_family
    from .runs.layout import LORA_SUFFIX, forge_name

    tokens = [t.token for t in parse_tokens(config.pivotal_tokens)]
    forge_file = lora.with_name(forge_name(lora.stem) + LORA_SUFFIX).is_file()
    family = _run_family(config)
    two_encoders = family is not None and len(get_family(family).text_encoder_parts) == 2  # SDXL's clip_l, clip_g
    return word_loading_lines(tokens, two_encoders, lora.stem, forge_file=forge_file)


def _run_family(config: TrainConfig) -> str | None:
    """The family a finished run trained (None when its model cannot be read any more)."""
    from .models.loading import family_name

    try:
        return family_name(config)
    except (OSError, ValueError):  # a model moved or broken since the run: these lines are a courtesy
        return None


def _host_limits(config: TrainConfig) -> list[str]:
    """config/hosts.py's limits of the run's adapter kind in the programs that load its family."""
    from .config.hosts import run_host_limits

    family = _run_family(config)
    return run_host_limits(config, family) if family else []


def _quit_now(config: TrainConfig, signum: int) -> None:
    """The second Ctrl-C / SIGTERM: record where the run is, then the process exits at once."""
    from .runs.states import STOPPED
    from .runs.writer import record_outcome
    from .train.signals import signal_name

    record_outcome(config.output_dir, STOPPED, f"Stopped at once by a second {signal_name(signum)} without "
                   "saving; continue from the last checkpoint with --resume auto.")
    print(f"error: stopped at once by a second {signal_name(signum)}; nothing was saved after the last "
          "checkpoint.", file=sys.stderr, flush=True)


def _exit_accelerate_quietly(code: int) -> None:
    """Under a user's `accelerate launch train_lora.py ...` (one process), accelerate turns any non-zero exit of
    its child into a 20-line CalledProcessError traceback under our one sentence. Asking the launcher to stop
    (SIGTERM, which it answers with a plain exit 143, no traceback) after the sentence is out avoids that."""
    import os
    import signal

    if code == 0 or "ACCELERATE_MIXED_PRECISION" not in os.environ or "LOCAL_RANK" in os.environ:
        return  # not under accelerate's single-process launcher (torchrun sets LOCAL_RANK)
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "accelerate" in parent and "launch" in parent:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher then terminates us; we are exiting anyway
        os.kill(os.getppid(), signal.SIGTERM)


def run_preflight(config: TrainConfig) -> int:
    """Preflight in a throw-away run directory, so the real one is never touched."""
    import tempfile

    from .train.loop import run_preflight as measure
    from .train.preflight import describe
    from .train.setup import setup

    with tempfile.TemporaryDirectory(prefix="stabletune-preflight-") as folder:
        session = setup(config.model_copy(update={"output_dir": folder, "resume_from_checkpoint": None}))
        print(describe(measure(session)))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from .demo import demo_config

    # The toy model is so small that one CPU thread is fastest (1.4 CPU-minutes where two threads took 6.6 on 2
    # cores): every CPU run now chooses its threads so (train/threads.py), the demo included.
    from .toy.bases import TOY_BASES

    config = demo_config(Path(args.output_dir), max_train_steps=args.max_train_steps, resume=args.resume,
                         network_type=args.network_type, concept=args.concept, family=args.family,
                         concept_images=args.concept_images, concept_word=args.concept_word, seed=args.seed)
    kind = {"lora": "A LoRA", "loha": "A LoHa", "lokr": "A LoKr"}[config.network_type]
    learns = args.concept_word or ("purple" if args.concept == "colour" else "to draw rings")
    print(f"Demo run in {config.output_dir}: {TOY_BASES[args.family].display_name}, which draws red, yellow, green "
          f"and cyan circles, squares and triangles, learns {learns} from {config.train_data_dir} ({config.max_train_steps} steps). "
          f"{kind} at learning rate {config.learning_rate:g}.")
    code = run_train(config)
    if code == 0:
        from .demo import make_gallery

        gallery = make_gallery(Path(config.output_dir))
        if gallery:
            print(f"Before/after gallery (same prompts and seeds at every sampling): {gallery}")
    return code


def run_export(checkpoint: Path, name: str | None) -> int:
    """Rebuild the run's model in a scratch run directory (so the real run's status, config and events stay
    as they are), load the checkpoint, and place the LoRA next to the run's other outputs, with every file the run
    writes beside it for a step (its EMA, Forge file, words, diffusers folder); a name of the user's is never
    replaced."""
    import tempfile

    from .runs.layout import RunPaths, step_lora_name
    from .train.checkpoint import CheckpointError, verify_checkpoint

    if name is not None and (not name or any(c in name for c in '/\\:*?"<>|') or name.startswith(".")):
        raise ConfigError([f"--name '{name}' is not a plain file name (the LoRA goes into the run's output folder); "
                           "use letters, digits, '-' and '_'."])  # the rule output_name follows (config/schema.py)
    checkpoint = checkpoint.resolve()
    paths = RunPaths(checkpoint.parent.parent)
    if not checkpoint.is_dir() or not paths.config.is_file():
        raise ConfigError([f"{checkpoint} is not a checkpoint folder of a run (RUN/checkpoints/step_NNNNNN, with "
                           "RUN/config.toml); give one of a run's checkpoint folders."])
    try:  # checked before any model loads, in the export's own words
        verify_checkpoint(checkpoint)
    except CheckpointError as exc:
        raise ConfigError([f"Cannot export: {exc.clause()}; export another checkpoint of the "
                           "run."]) from None  # the reason names the checkpoint folder
    from .train.loop import export, resume  # the engine (diffusers, peft) loads only when the input is good
    from .train.outcome import RunFailed, is_disk_full
    from .train.setup import setup

    values = read_toml(paths.config)
    with tempfile.TemporaryDirectory(prefix="stabletune-export-") as scratch:
        config = build_config({**values, "output_dir": scratch, "resume_from_checkpoint": str(checkpoint),
                               "validation_prompt": "", "perceptual_lambda": 0.0, "early_stopping": False})
        session = setup(config)
        resume(session)
        name = name or step_lora_name(config.output_name, session.state.step)
        target = paths.lora(name)
        if target.exists():  # refused before the export's minutes, when the main file's name is taken
            raise ConfigError([f"{target} already exists; pass --name to write the LoRA under another name."])
        made = session.run.paths.output
        before = set(made.iterdir())
        try:
            export(session, name)
            # Everything the run itself writes for a step: NAME-ema, NAME_forge, NAME_embeddings/, NAME_diffusers/.
            written = sorted(set(made.iterdir()) - before, key=lambda p: p != made / target.name)  # the LoRA first
            if taken := next((paths.output / p.name for p in written if (paths.output / p.name).exists()), None):
                raise ConfigError([f"{taken} already exists; pass --name to write the LoRA under another name."])
            others = [p.name + ("/" if p.is_dir() else "") for p in written[1:]]
            paths.output.mkdir(parents=True, exist_ok=True)
            place_exported(written, paths.output)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise RunFailed(f"The disk is full: the LoRA could not be written to {target.parent} (nothing was left "
                            "there); free some space and run the same export again.") from None
    print(f"LoRA written to {target}")
    if others:
        print(f"Beside it: {', '.join(others)}")
    return 0


def place_exported(written: list[Path], output: Path) -> None:
    """Copy the export's files and folders into the run's `output`, each whole or not at all (atomic_path); when
    one fails, the ones this export already placed are removed again, so that the same export can be retried."""
    import shutil

    from .atomic import atomic_path

    placed: list[Path] = []
    try:
        for source in written:
            with atomic_path(output / source.name, folder=source.is_dir()) as tmp:
                if source.is_dir():
                    shutil.copytree(source, tmp, dirs_exist_ok=True)
                else:
                    shutil.copyfile(source, tmp)
            placed.append(output / source.name)
    except BaseException:
        for path in placed:  # only what this export made a moment ago: the names were free before it
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        raise


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
        from .runs.layout import RunPaths
        from .runs.reader import RunReader

        if not (RunPaths(path).status.is_file() or RunPaths(path).config.is_file()):
            raise ConfigError([f"{path} is not a run folder (it has no status.json or config.toml); give a LoRA "
                               ".safetensors file or a folder StableTune trained into."])
        reader = RunReader(path)
        print(json.dumps(reader.status(), indent=1))
        print(f"{len(reader.metrics())} metric lines, {len(reader.events())} events, "
              f"{len(reader.checkpoints())} checkpoints, LoRAs: {[p.name for p in reader.loras()]}")
        return 0
    from safetensors import safe_open

    from .lora.names import module_and_part
    from .lora.resize import lora_file_problem

    if not path.exists():
        raise ConfigError([f"{path} does not exist; give a LoRA .safetensors file or a run folder."])
    if problem := lora_file_problem(path):
        raise ConfigError([problem])
    from .tools.lora_file import not_a_lora

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
        keys = list(f.keys())
    if (what := not_a_lora([k for k in keys if not k.startswith("bundle_emb.")])) and not \
            any(k.startswith("bundle_emb.") for k in keys):
        raise ConfigError([f"{path.name} is {what} ({len(keys)} tensors), not a LoRA; inspect describes LoRA files "
                           "and run folders."])
    words = sorted({k.split(".", 2)[1] for k in keys if k.startswith("bundle_emb.")})  # pivotal tuning's words
    modules = {module_and_part(k)[0] for k in keys if not k.startswith("bundle_emb.")}
    bundled = f", the words {', '.join(words)} (bundle_emb)" if words else ""
    print(f"{path.name}: {len(keys)} tensors, {len(modules)} LoRA modules{bundled}")
    for key in sorted(metadata):
        value = metadata[key]
        print(f"  {key} = {value if len(value) < 120 else value[:117] + '...'}")
    return 0
