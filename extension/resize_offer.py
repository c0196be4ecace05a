"""The Diagnostics tab's resize offer: from the spectra a run already recorded, how many of its ranks the LoRA
really uses and which smaller rank keeps nearly all of it; and the button's job, `python -m stabletune_core
resize` run by the engine's Python (the UI never imports torch), writing a new file beside the LoRA.

`suggest` repeats `stabletune_core.lora.resize.suggest_rank` on the recorded numbers (that module needs
torch); tests/test_ui_parts.py checks that both say the same.
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

from stabletune_core.launch import engine_env
from stabletune_core.runs.layout import RunPaths

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

ENERGY = 0.99  # the share of ||dW||_F^2 a suggested rank must keep
RESIZE_TIMEOUT_S = 600
WRITTEN = "Resized LoRA written to "  # the CLI's last line on success


def latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest spectrum of every module (records as extension.diagnostics.spectra returns them)."""
    newest: dict[str, dict[str, Any]] = {}
    for record in records:
        if record["module"] not in newest or record["step"] >= newest[record["module"]]["step"]:
            newest[record["module"]] = record
    return list(newest.values())


def suggest(records: list[dict[str, Any]], energy: float = ENERGY) -> tuple[int, str] | None:
    """(rank, sentence) such as (8, "this LoRA uses ~5 of its 16 ranks: resize to 8 keeps 99 % of its
    energy") from the newest spectra; None when no smaller power-of-two rank keeps `energy`."""
    trained = [r for r in latest(records) if r["sv"] and r["sv"][0] > 0]
    if not trained:
        return None
    current = max(len(r["sv"]) for r in trained)
    total = sum(s * s for r in trained for s in r["sv"])
    uses = sum(r["effective_rank"] for r in trained) / len(trained)
    candidate = 1
    while candidate < current:
        kept = sum(s * s for r in trained for s in r["sv"][:candidate]) / total
        if kept >= energy:
            percent = math.floor(kept * 100 + 1e-6)  # never claim more than is kept
            return candidate, (f"this LoRA uses ~{round(uses)} of its {current} ranks: resize to {candidate} "
                               f"keeps {percent} % of its energy")
        candidate *= 2
    return None


def run_lora(run: Path | None) -> Path | None:
    """The LoRA the run exported (RUN/output/OUTPUT_NAME.safetensors), else its oldest .safetensors there
    (newer ones may be earlier resizes)."""
    if run is None:
        return None
    output = RunPaths(run).output
    try:
        with open(RunPaths(run).config, "rb") as f:
            name = str(tomllib.load(f).get("output_name") or "")
    except (OSError, ValueError):
        name = ""
    if name and (output / f"{name}.safetensors").is_file():
        return output / f"{name}.safetensors"
    files = sorted(output.glob("*.safetensors"), key=lambda p: p.stat().st_mtime) if output.is_dir() else []
    return files[0] if files else None


def resize_command(engine_python: str, lora: Path, rank: int) -> list[str]:
    """The argv (never a shell string) that writes LORA-rN.safetensors beside `lora`."""
    return [engine_python, "-m", "stabletune_core", "resize", str(lora), "--rank", str(rank)]


def resize(engine_python: str, lora: Path | None, rank: Any) -> str:
    """Run the resize and say what happened, in one or two sentences for the tab."""
    if lora is None:
        return "⚠ This run has no exported LoRA yet (it is written when the run finishes or is stopped)."
    try:
        rank = int(rank)
    except (TypeError, ValueError):
        return f"⚠ The new rank must be a whole number, not {rank!r}."
    try:
        done = subprocess.run(resize_command(engine_python, lora, rank), capture_output=True, text=True,
                              timeout=RESIZE_TIMEOUT_S, env=engine_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"⚠ The resize could not run ({exc})."
    written = [line[len(WRITTEN):] for line in done.stdout.splitlines() if line.startswith(WRITTEN)]
    if done.returncode == 0 and written:
        summary = done.stdout.strip().splitlines()[-2] if len(done.stdout.strip().splitlines()) > 1 else ""
        return f"Resized to rank {rank}: `{written[-1]}` (the original is unchanged). {summary}"
    reason = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
    return f"⚠ Resize failed: {reason.removeprefix('error: ')}"
