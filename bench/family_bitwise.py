"""A new family must not change a bit of an existing family's runs (DESIGN.md, "Model families behind one face").

Trains the tiny SD1, SDXL, FLUX.2 Klein (models/flux2_klein/tiny.py) and Z-Image (models/z_image/tiny.py) with this
checkout and with a baseline revision (default: where this branch left main), the same command line in each, and
compares what the runs wrote: every tensor of the exported LoRA, every step's loss and gradient norm, and the
validation images byte for byte. The baseline tree is written out
with `git archive` into a temporary folder, so no checkout (main included) is touched.

    python bench/family_bitwise.py                      # baseline: git merge-base HEAD main
    python bench/family_bitwise.py --baseline c7db623 --families sd1
    python bench/family_bitwise.py --families klein z_image

Exit status 0 when every family is bitwise equal, 1 otherwise. About a minute per family on one CPU core.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


FAMILIES = ["sd1", "sdxl", "klein", "z_image"]


def baseline_tree(revision: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def build_model(family: str, folder: Path) -> Path:
    """The tiny model of `family`, built from this checkout (both trees train on the same files)."""
    if family == "klein":
        from stabletune_core.models.flux2_klein.tiny import build_tiny_klein

        return build_tiny_klein(folder / family, seed=0)
    if family == "z_image":
        from stabletune_core.models.z_image.tiny import build_tiny_z_image

        return build_tiny_z_image(folder / family, seed=0)
    from stabletune_core.models.sd.tiny import build_tiny_sd1, build_tiny_sdxl

    return {"sd1": build_tiny_sd1, "sdxl": build_tiny_sdxl}[family](folder / family, seed=0)


def train(tree: Path, model: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    """Six steps with every random stream in use (LoRA dropout, flips, an epoch boundary), a checkpoint, a resume
    point's worth of state and validation images at steps 0 and 6."""
    flags = dict(pretrained_model_name_or_path=model, train_data_dir=data, output_dir=out, resolution=64,
                 bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3,
                 max_train_steps=6, lora_rank=4, lora_alpha=8, lora_dropout=0.1, save_steps=3, seed=11,
                 save_precision="fp32", validation_split=0, validation_prompt="a red circle", validation_steps=6,
                 validation_inference_steps=3, num_validation_images=1, validation_loss_every=3,
                 diagnostics_every=3, activation_stats_every=3)
    args = [a for k, v in flags.items() for a in (f"--{k}", str(v))] + ["--random_flip"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("STABLETUNE_FAULTS", None)
    return subprocess.run([sys.executable, "-m", "stabletune_core", "train", *args], cwd=tree, env=env,
                          capture_output=True, text=True)


def fingerprint(run: Path) -> dict[str, object]:
    """What the comparison looks at: LoRA tensors, per-step numbers, sample bytes."""
    from safetensors.torch import load_file

    lora = load_file(run / "output" / "lora.safetensors")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    samples = {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted((run / "samples").rglob("*.png"))}
    numbers = [(m["step"], m["loss"], m["grad_norm"], m.get("val_loss")) for m in metrics]
    return {"lora": lora, "numbers": numbers, "samples": samples}


def differences(a: dict, b: dict) -> list[str]:
    import torch

    found = []
    if a["lora"].keys() != b["lora"].keys():
        found.append("LoRA keys differ")
    else:
        unequal = [k for k in a["lora"] if not torch.equal(a["lora"][k], b["lora"][k])]
        if unequal:
            found.append(f"{len(unequal)} of {len(a['lora'])} LoRA tensors differ (e.g. {unequal[0]})")
    if a["numbers"] != b["numbers"]:
        found.append("per-step loss / grad norm / val loss differ")
    if a["samples"] != b["samples"]:
        found.append(f"validation images differ ({sorted(set(a['samples']) ^ set(b['samples'])) or 'bytes'})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="Revision to compare with (default: git merge-base HEAD main).")
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    args = parser.parse_args()
    revision = args.baseline or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True,
                                               capture_output=True, text=True).stdout.strip()
    from stabletune_core.demo import draw_demo_dataset

    failed = False
    with tempfile.TemporaryDirectory(prefix="family-bitwise-") as tmp:
        tmp = Path(tmp)
        base = baseline_tree(revision, tmp / "baseline")
        data = draw_demo_dataset(tmp / "data", count=8, size=64, seed=0)
        print(f"baseline {revision[:12]} vs this checkout ({ROOT.name})")
        for family in args.families:
            model, prints = build_model(family, tmp / "models"), {}
            for name, tree in (("baseline", base), ("this", ROOT)):
                done = train(tree, model, data, tmp / "runs" / family / name)
                if done.returncode != 0:
                    print(f"{family}: the {name} run failed:\n{done.stderr[-2000:]}")
                    return 2
                prints[name] = fingerprint(tmp / "runs" / family / name)
            found = differences(prints["baseline"], prints["this"])
            failed |= bool(found)
            lora = prints["this"]["lora"]
            print(f"{family}: {'BITWISE EQUAL' if not found else 'DIFFERENT: ' + '; '.join(found)} "
                  f"({len(lora)} LoRA tensors, {len(prints['this']['numbers'])} steps, "
                  f"{len(prints['this']['samples'])} validation images)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
