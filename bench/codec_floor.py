"""The toy bases' codec floor around the whole hue circle (issue 35.1): no LoRA on the denoiser draws a colour closer
than the base's VAE draws it back.

For every hue in 10-degree steps, 12 drawings of the toy world (its three base shapes, sizes and pale backgrounds) in
that hue (saturation 0.8, value 0.85, as the concept suite's colours) go through the VAE (encode to the posterior's
mode, decode); a hue's floor is the mean of its images' hue shifts in degrees (toy/codec.py, the judge's hue measure).
Beside it, the concept suite's own codec floor of its six colours (bench/concept_suite.py's measure: against the
training images' mean hue, so it includes their own scatter of ~1 degree).

    OMP_NUM_THREADS=1 python bench/codec_floor.py                        # the shipped toy SD 1.x base
    python bench/codec_floor.py --family flux2_klein                     # the shipped toy Klein
    python bench/codec_floor.py --weights OLD_WEIGHTS_DIR --label before # another build's weights folder

Prints a markdown table (for bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def floors(vae_folder: Path, family: str = "sd1") -> tuple[dict[int, float], dict[str, float]]:
    """(hue -> codec floor, suite colour -> the concept suite's codec floor) of the `family` VAE in `vae_folder`."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLFlux2

    from stabletune_core.toy.codec import hue_circle_floor, round_trip
    from stabletune_core.toy.world import draw_scene

    sys.path.insert(0, str(ROOT / "bench"))
    from concept_suite import SUITE_COLORS, Concept, codec_floor

    torch.set_num_threads(1)  # the toy codec is dispatch-bound
    vae_class = AutoencoderKLFlux2 if family == "flux2_klein" else AutoencoderKL
    through = round_trip(vae_class.from_pretrained(str(vae_folder), local_files_only=True).eval())
    suite = {name: codec_floor(Concept(name), [draw_scene(s) for s in Concept(name).scenes()], through)
             for name in SUITE_COLORS}
    return hue_circle_floor(through), suite


def table(columns: dict[str, tuple[dict[int, float], dict[str, float]]]) -> str:
    """Markdown: one row per hue, then the suite's colours, then the worst and mean hue; one column per codec."""
    labels = list(columns)
    lines = ["| hue | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    hues = list(next(iter(columns.values()))[0])
    for hue in hues:
        lines.append(f"| {hue} | " + " | ".join(f"{columns[k][0][hue]:.1f}" for k in labels) + " |")
    for name in next(iter(columns.values()))[1]:
        lines.append(f"| {name} (suite) | " + " | ".join(f"{columns[k][1][name]:.1f}" for k in labels) + " |")
    lines.append("| worst hue | " + " | ".join(f"{max(columns[k][0].values()):.1f}" for k in labels) + " |")
    lines.append("| mean hue | " + " | ".join(
        f"{sum(columns[k][0].values()) / len(columns[k][0]):.1f}" for k in labels) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["sd1", "flux2_klein"], default="sd1", help="which toy base")
    parser.add_argument("--weights", type=Path, action="append", default=None,
                        help="a toy weights folder of that family (default: the shipped one); repeat to compare")
    parser.add_argument("--label", action="append", default=None, help="a column name per --weights")
    args = parser.parse_args(argv)

    if args.family == "flux2_klein":
        from stabletune_core.toy.klein import WEIGHTS, materialize
    else:
        from stabletune_core.toy import WEIGHTS, materialize

    weights = args.weights or [WEIGHTS]
    labels = args.label or [w.name if w != WEIGHTS else "shipped" for w in weights]
    if len(labels) != len(weights):
        parser.error("give one --label per --weights")
    columns = {label: floors(materialize(folder) / "vae", args.family) for label, folder in zip(labels, weights)}
    text = table(columns)
    print(text)
    return text


if __name__ == "__main__":
    main()
