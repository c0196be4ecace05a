"""What the transformer families' toy-base tests (test_toy_klein.py, test_toy_z_image.py) check the same way: the
demo run as a user runs it, the exported LoRA loaded in the family's own pipeline, and the measures of the toy judge
(toy/score.py) in degrees over 8 seeds per prompt.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from stabletune_core.toy.evaluate import SCORE_SEEDS, learning_report, mean, render, scores
from stabletune_core.toy.judge import concept_reference, judge_samples, passed, sample_folders
from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR, base_prompts, concept_prompts

ROOT = Path(__file__).resolve().parent.parent
SEEDS = SCORE_SEEDS  # 8 seeds per prompt
CONCEPT_BEFORE_MIN_DEG = 30.0  # the base never saw purple
DRIFT_MAX_DEG = 3.0  # every base colour within 3 deg of the base's own image at the same prompt and seed
SHAPES_MIN = 0.90  # the LoRA's images of the base prompts show their prompt's shape


def run_cli(*args: str, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "STABLETUNE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_demo(family: str, run: Path, cache: Path) -> tuple[Path, str]:
    """`demo --family FAMILY`, run as a user runs it; returns (run dir, console output)."""
    done = run_cli("stabletune_core", "demo", "--family", family, "--output_dir", str(run), cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stdout + done.stderr


def lora_pipeline(load_pipeline: Callable[[Path], Any], base: Path, lora: Path) -> Any:
    """A fresh pipeline of the toy base with an exported LoRA, loaded as a user would (the family's own loader)."""
    pipe = load_pipeline(base)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="demo")
    return pipe


def base_images_of(pipe: Any) -> dict[str, list]:
    """The base's images of every base prompt and of the concept prompts, 8 seeds each (the base measures and the
    demo's drift read the same images)."""
    return render(pipe, base_prompts() + concept_prompts(), SEEDS)


def base_measures(base_images: dict[str, list]) -> tuple[float, float, float]:
    """(right, shapes, concept hue error in degrees) of the base's images: right colour (within 6 degrees of the
    palette) and right shape, right shape, and the never-seen concept's distance from its training images."""
    from stabletune_core.toy.evaluate import concept_reference_hue

    base = scores({p: base_images[p] for p in base_prompts()})
    concept = scores({p: base_images[p] for p in concept_prompts()}, {CONCEPT_COLOR: concept_reference_hue()})
    return (mean(p["right"] for p in base.values()), mean(p["shape"] for p in base.values()),
            mean(p["hue_error"] for p in concept.values()))


def demo_report(label: str, run: Path, base_images: dict[str, list], lora_pipe: Any) -> dict:
    """The demo's 8-seed learning report (toy/evaluate.learning_report) with the exported LoRA."""
    tuned = render(lora_pipe, base_prompts() + concept_prompts(), SEEDS)
    report = learning_report(base_images, tuned, concept_reference(run, CONCEPT_COLOR))
    print(f"{label} demo, 8 seeds per prompt: {report}")
    return report


def check_report(report: dict, *, concept_max_deg: float, drift_max_deg: float = DRIFT_MAX_DEG,
                 shapes_min: float = SHAPES_MIN) -> None:
    assert report["concept_before"] >= CONCEPT_BEFORE_MIN_DEG, report
    assert report["concept_after"] <= concept_max_deg, report
    assert max(report["drift"].values()) <= drift_max_deg, report
    assert report["shapes"] >= shapes_min, report


def check_console_summary(console: str) -> None:
    """The run's console ends with the learning summary in degrees, purple closer than it started."""
    kept = "kept: " + ", ".join(rf"{color} drift (\d+) deg" for color in BASE_COLORS)  # issue 35.3: every one
    line = re.search(rf"Learning summary.*: {CONCEPT_COLOR}: (\d+) deg off -> (\d+) deg off; {kept}; shapes (\d+) %",
                     console)
    assert line, console[-2000:]
    first, last = int(line.group(1)), int(line.group(2))
    assert first >= CONCEPT_BEFORE_MIN_DEG and last < first, line.group(0)


def check_demo_learns(label: str, run: Path, console: str, base_images: dict[str, list], lora_pipe: Any, *,
                      concept_max_deg: float) -> dict:
    """The demo's 8-seed measures with the exported LoRA meet the targets, and the run's console says them in
    degrees; returns the learning report."""
    report = demo_report(label, run, base_images, lora_pipe)
    check_report(report, concept_max_deg=concept_max_deg)
    check_console_summary(console)
    return report


def check_summary_passes(run: Path, console: str, *, concept_max_deg: float) -> dict:
    """What the user reads: the run's own summary, on its validation prompts and seeds (2 per prompt), meets the
    targets too, and says pass; returns the last sampling's measures."""
    last = judge_samples(sample_folders(run)[-1], run)
    print(f"the run's own summary measures: {last}")
    assert last["concept"][CONCEPT_COLOR] <= concept_max_deg, last
    assert max(last["drift"].values()) <= DRIFT_MAX_DEG and last["shapes"] >= SHAPES_MIN, last
    assert passed(last) and re.search(r"Learning summary.*; pass \(", console), console[-2000:]
    return last
