"""Trials towards a toy SD 1.x codec that carries the whole hue circle (issue 35.1), each measured by bench/codec_floor's
per-hue floor (toy/codec.py). Three ways, from cheapest to dearest:

- decoder: the shipped VAE's decoder alone trains on shapes of any hue (build.polish_decoder's loss, the encoder
  frozen, so the denoiser's latents stay valid). Enough only if the encoder keeps the hues apart.
- anchored: encoder and decoder train on shapes of any hue while an anchor holds the encoder's posterior on the
  toy world's palette images (the latents the denoiser learned, the demos' purple and ring included) where it was.
- scratch: the codec's first stage from scratch on shapes of any hue with a mean-colour term (build.train_vae's
  `draw` and `mean_colour_weight`); a codec from here needs the denoiser retrained on its latents (a full build).

    OMP_NUM_THREADS=1 python bench/codec_trials.py probe       # does the shipped encoder keep the hues apart?
    OMP_NUM_THREADS=1 python bench/codec_trials.py decoder --steps 300
    OMP_NUM_THREADS=1 python bench/codec_trials.py anchored --steps 400 --lr 2e-3 --mean-colour-weight 20
    OMP_NUM_THREADS=1 python bench/codec_trials.py scratch --steps 1000 --mean-colour-weight 10 --save OUT.pt
    OMP_NUM_THREADS=1 python bench/codec_trials.py decoder --steps 300 --start OUT.pt    # its decoder polish

Prints each hue's floor in degrees, the worst and the mean; the RESULTS.md section of issue 35.1 has the numbers.
"""
from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def anchored(vae, steps: int, batch: int, lr: float, mean_colour_weight: float, anchor_weight: float, seed: int,
             log: Callable[[str], None]) -> None:
    """Encoder and decoder on any hue; an anchor (its weight against the reconstruction loss) holds the encoder's
    posterior mean and spread on palette images, as a fraction of the posterior's variance."""
    import numpy as np
    import torch

    from stabletune_core.toy.build import draw_any_hue_batch, pixels
    from stabletune_core.toy.codec import palette_batch, reconstruction_loss

    torch.manual_seed(seed)  # the posterior samples
    rng = random.Random(seed)
    reference = copy.deepcopy(vae).requires_grad_(False).eval()
    vae.requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    vae.train()
    losses, drifts = [], []
    for step in range(steps):
        x = draw_any_hue_batch(rng, batch)
        loss = reconstruction_loss(x, vae.decode(vae.encode(x).latent_dist.sample()).sample - x, mean_colour_weight)
        kept = pixels(palette_batch(rng, batch))
        moved = vae.encode(kept).latent_dist
        with torch.no_grad():
            held = reference.encode(kept).latent_dist
        drift = ((moved.mean - held.mean).pow(2).mean() + (moved.std - held.std).pow(2).mean()) / held.var.mean()
        optimizer.zero_grad(set_to_none=True)
        (loss + anchor_weight * drift).backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        drifts.append(float(drift.detach()))
        if step % 50 == 0 or step == steps - 1:
            log(f"anchored step {step}/{steps} loss {np.mean(losses[-50:]):.4f} "
                f"palette latent drift {np.mean(drifts[-50:]):.4f}")
    vae.eval()


def encoder_probe(vae) -> dict[int, float]:
    """hue -> how far the encoder's latent (posterior mean) moves from this hue to the next 10 degrees on, as a
    fraction of the posterior's spread (norms over the latent), mean over four drawings (same shape and place)."""
    import torch

    from stabletune_core.toy.build import pixels
    from stabletune_core.toy.codec import HUE_STEP, rgb_of_hue
    from stabletune_core.toy.world import SHAPES, Scene, draw_scene

    hues = list(range(0, 360 + HUE_STEP, HUE_STEP))
    moves = {hue: 0.0 for hue in hues[:-1]}
    with torch.no_grad():
        for seed in range(4):
            shape = SHAPES[seed % len(SHAPES)]
            posterior = vae.encode(pixels([draw_scene(Scene("any", shape, 7_000 + seed, rgb=rgb_of_hue(h)))
                                           for h in hues])).latent_dist
            for i, hue in enumerate(hues[:-1]):
                step = (posterior.mean[i + 1] - posterior.mean[i]).norm() / posterior.std[i].norm()
                moves[hue] += float(step) / 4
    return moves


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trial", choices=["probe", "decoder", "anchored", "scratch"])
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4, help="anchored only (decoder: the polish's, scratch: "
                                                                "the first stage's)")
    parser.add_argument("--mean-colour-weight", type=float, default=4.0, help="anchored and scratch")
    parser.add_argument("--anchor-weight", type=float, default=10.0, help="anchored only")
    parser.add_argument("--save", type=Path, default=None, help="write the trained VAE's state dict here")
    parser.add_argument("--start", type=Path, default=None,
                        help="probe, decoder, anchored: start from this --save'd state dict, not the shipped VAE")
    args = parser.parse_args(argv)

    import torch
    from diffusers import AutoencoderKL

    from stabletune_core.models.sd.tiny import VAE_CONFIG
    from stabletune_core.toy import toy_base_model
    from stabletune_core.toy.build import BUILD_SEED, TOY_VAE_CONFIG, draw_any_hue_batch, polish_decoder, train_vae
    from stabletune_core.toy.codec import hue_circle_floor, round_trip

    torch.set_num_threads(1)  # the toy codec is dispatch-bound
    started = time.time()
    log = lambda message: print(f"{message} ({time.time() - started:.0f} s)", flush=True)  # noqa: E731
    if args.trial == "scratch":
        torch.manual_seed(BUILD_SEED + 1)
        vae = AutoencoderKL(**dict(VAE_CONFIG, **TOY_VAE_CONFIG))
        train_vae(vae, args.steps, args.batch, log, draw=draw_any_hue_batch, mean_colour_weight=args.mean_colour_weight)
    else:
        vae = AutoencoderKL.from_pretrained(str(toy_base_model() / "vae"), local_files_only=True).eval()
        if args.start:
            vae.load_state_dict(torch.load(args.start))
        if args.trial == "probe":
            moves = encoder_probe(vae)
            print(" ".join(f"{hue}:{value:.2f}" for hue, value in moves.items()))
            return moves
        if args.trial == "decoder":
            polish_decoder(vae, args.steps, args.batch, log, draw=draw_any_hue_batch)
        else:
            anchored(vae, args.steps, args.batch, args.lr, args.mean_colour_weight, args.anchor_weight,
                     BUILD_SEED + 17, log)
    if args.save:
        torch.save(vae.state_dict(), args.save)
    floor = hue_circle_floor(round_trip(vae.eval()))
    print(" ".join(f"{hue}:{value:.1f}" for hue, value in floor.items()))
    print(f"worst hue {max(floor.values()):.1f} deg (at {max(floor, key=floor.get)}), "
          f"mean {sum(floor.values()) / len(floor):.1f} deg")
    return floor


if __name__ == "__main__":
    main()
