"""How a run ends: `finished`, `stopped`, or `failed` with one sentence (DESIGN.md, "Every run ends in a known
state").

Everything that can go wrong on the way comes here as an exception. Expected failures (bad input, a model or
dataset that cannot be used, a full disk, out of memory, a run that only produced NaN) already carry the
sentence the user needs; anything else is a bug, and the user gets a one-line "internal error" sentence while
the traceback goes to RUN/traceback.txt instead of the console. Either way status.json says `failed` with the
sentence, stderr gets `error: <sentence>`, and the exit code is non-zero.

This module imports neither torch nor the loop: it must work when importing them is what failed.
"""
from __future__ import annotations

import errno
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..runs.jsonfiles import read_json
from ..runs.layout import RunPaths
from ..runs.states import FAILED
from ..runs.writer import record_outcome

EXIT_FAILED = 1
EXIT_CONFIG = 2  # bad input, refused before anything ran (argparse uses 2 too)
EXIT_OUT_OF_MEMORY = 3
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


SENTENCE_ERRORS = ("DatasetError", "ModelLoadError", "CheckpointError")  # their message is the sentence


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the sentence for the user (console and status.json)."""


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as an OSError, or as the RuntimeError torch.save raises for it, or the SafetensorError (not a
    RuntimeError; matched by name, like OutOfMemoryStop) safetensors' save_file raises: the final export's."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        text = str(exc)
        if (isinstance(exc, RuntimeError) or type(exc).__name__ == "SafetensorError") and (
                "No space left" in text or "file write failed" in text or "Disk quota" in text):
            return True
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False


def failure_sentences(exc: BaseException, output_dir: str | None) -> tuple[list[str], int] | None:
    """The sentences and exit code of an expected failure; None for a bug."""
    if isinstance(exc, ConfigError):
        return list(exc.problems), EXIT_CONFIG
    # Matched by name: importing their modules imports torch, which a config error should not wait for.
    if type(exc).__name__ == "OutOfMemoryStop":
        return [str(exc)], EXIT_OUT_OF_MEMORY
    if isinstance(exc, RunFailed) or type(exc).__name__ in SENTENCE_ERRORS:
        return [str(exc)], EXIT_FAILED
    if is_disk_full(exc):
        where = f" in {output_dir}" if output_dir else ""
        return [f"The disk is full: StableTune could not write{where} (No space left on device); free some "
                "space, then continue the run with --resume auto (its last good checkpoint is kept)."], EXIT_FAILED
    if isinstance(exc, PermissionError) and exc.filename:
        return [f"Permission denied for {exc.filename}; choose files and folders you can read and write."], \
            EXIT_FAILED
    return None


def report_failure(exc: BaseException, output_dir: str | None, *, may_write_status: bool = True) -> int:
    """Print the sentence, record it in RUN/status.json, return the exit code."""
    known = failure_sentences(exc, output_dir)
    if known is None:
        where = save_traceback(exc, output_dir)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        sentences, code = [f"internal error: {type(exc).__name__}: {first}; please report it, the traceback is in "
                           f"{where}."], EXIT_FAILED
    else:
        sentences, code = known
    for sentence in sentences:
        print(f"error: {sentence}", file=sys.stderr, flush=True)
    if output_dir and may_write_status:
        record_outcome(output_dir, FAILED, " ".join(sentences))
    return code


#: How many tracebacks of commands without a run folder (the tools, the UI's queries) are kept: the newest.
TRACEBACKS_KEPT = 20


def traceback_folder() -> Path:
    """Where a command without a run folder keeps its tracebacks: the StableTune cache, not the system temp."""
    from ..cache import cache_root

    return cache_root() / "tracebacks"


def save_traceback(exc: BaseException, output_dir: str | None) -> Path:
    """The traceback in RUN/ (a run), else in `traceback_folder()` (the newest TRACEBACKS_KEPT kept), else in the
    system temp folder; the console when none can be written."""
    text = "".join(traceback.format_exception(exc))
    if output_dir:
        try:
            if Path(output_dir).is_dir():
                path = RunPaths(Path(output_dir)).traceback
                path.write_text(text, encoding="utf-8")
                return path
        except OSError:
            pass
    name = f"traceback-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.time_ns() % 10**9:09d}.txt"
    for folder in (traceback_folder(), Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / (name if folder == traceback_folder() else f"stabletune-{name}")
            path.write_text(text, encoding="utf-8")
        except OSError:
            continue
        if folder == traceback_folder():
            _keep_newest(folder, TRACEBACKS_KEPT)
        return path
    print(text, file=sys.stderr)  # nowhere to keep it: the console is the last resort
    return Path("the console above")


def _keep_newest(folder: Path, kept: int) -> None:
    """Remove all but the `kept` newest tracebacks of `folder` (each command writes its own)."""
    try:
        files = sorted(folder.glob("traceback-*.txt"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
        for old in files[kept:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # another process pruning at the same time: the next command tidies up


def owns_status(config: Any) -> bool:
    """May a failure be written into this run directory's status.json? Only when it does not belong to another
    run: this process wrote it; else never in the dataset or in an earlier run's folder, and otherwise when there
    is no status yet, an earlier failed attempt, or the run is being resumed.

    `config` may be the few fields that a config which failed to parse still gave (cli.run_command)."""
    from ..config import output_inside_dataset, output_inside_reg_dir
    from ..runs.lock import holder

    paths = RunPaths(Path(config.output_dir).expanduser())
    if paths.root.exists() and not paths.root.is_dir():
        return False
    if holder(paths.root):
        return False  # a live trainer's folder (runs/lock.py): its status.json is that trainer's
    previous = read_json(paths.status) if paths.status.is_file() else None
    if previous and previous.get("pid") == os.getpid():
        return True  # this run's own folder: its metrics and samples are no earlier run
    data_dir = getattr(config, "train_data_dir", None)
    if output_inside_dataset(paths.root, Path(data_dir).expanduser() if data_dir else None):
        return False  # the user's dataset: never write into it
    reg_dir = getattr(config, "reg_data_dir", None)
    if output_inside_reg_dir(paths.root, Path(reg_dir).expanduser() if reg_dir else None):
        return False  # the user's class images: never write among them either
    if paths.root.is_dir() and not config.resume_from_checkpoint and not getattr(config, "overwrite_output_dir", 0):
        if isinstance(config, TrainConfig):
            from ..runs.earlier import earlier_run

            if earlier_run(paths, config):
                return False  # an earlier run's folder, refused and left as it was
        elif any(p.name != paths.status.name for p in paths.root.iterdir()):
            return False  # a folder holding files we cannot tell are ours
    if not previous:
        return True
    return previous.get("state") == FAILED or bool(config.resume_from_checkpoint)


def prepare_status_dir(config: Any) -> bool:
    """Create the run directory when it can be ours (so the UI sees the failure); False when it must not be
    written to."""
    if not owns_status(config):
        return False
    try:
        Path(config.output_dir).expanduser().mkdir(parents=True, exist_ok=True)
        return True
    except OSError:
        return False
