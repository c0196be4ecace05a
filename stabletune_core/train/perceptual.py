"""LPIPS perceptual regulariser: the image decoded from the predicted x0 against the training image.

Decoding through the VAE with gradients is the expensive part (activation memory of the decoder), so the
term is added only on every `perceptual_every`-th step, only for images noised below
`perceptual_timestep_max` (from very noisy latents the predicted x0 is a blur and LPIPS says nothing), and for
at most `perceptual_batch` images per sampler batch. The term joins the gradients as lambda x the mean LPIPS
of the step's chosen images, whatever the micro-batch.

LPIPS = an ImageNet backbone (AlexNet/VGG/SqueezeNet from torchvision) + linear layers calibrated on human
judgements. The linear layers ship inside the lpips package; the backbone weights come from torchvision's
download into the torch hub cache. With `local_files_only` (the default) and that file missing, the run
refuses to start (one sentence saying which file goes where), unless `perceptual_random_backbone` asks for
a random backbone; then the event log and the console say, once, that the term is NOT the LPIPS perceptual
metric. With `local_files_only` off, torchvision downloads the weights as usual.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..data.examples import DatasetView
from ..models.base import ModelBundle, Objective

_WEIGHTS = {"alex": "AlexNet_Weights", "vgg": "VGG16_Weights", "squeeze": "SqueezeNet1_1_Weights"}


def backbone_weights_file(net: str) -> Path:
    """Where torchvision looks for (and would download) the backbone's ImageNet weights."""
    from torchvision import models

    url = getattr(models, _WEIGHTS[net]).IMAGENET1K_V1.url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def perceptual_problems(config: TrainConfig) -> list[str]:
    """Why the perceptual term cannot run as asked (empty when it can); checked before any model loads."""
    if config.perceptual_lambda <= 0 or config.perceptual_random_backbone or not config.local_files_only:
        return []  # (with local_files_only off, torchvision downloads the weights on first use)
    path = backbone_weights_file(config.perceptual_net)
    if path.is_file():
        return []
    from torchvision import models

    url = getattr(models, _WEIGHTS[config.perceptual_net]).IMAGENET1K_V1.url
    return [f"perceptual_lambda needs the ImageNet weights of the LPIPS {config.perceptual_net} backbone, which "
            f"are not at {path} and local_files_only forbids downloading them; put {path.name} (from {url}) "
            f"into {path.parent}, set "
            "local_files_only false, or set perceptual_lambda 0 (perceptual_random_backbone true trains with a "
            "random backbone, which is NOT the perceptual metric)."]


class Perceptual:
    """The LPIPS network and the per-step term the step adds to the loss: the family's decode of the clean
    latents its objective reads from the prediction, against the training image. `description` says, once,
    what runs (setup writes it to the console and events.jsonl)."""

    def __init__(self, config: TrainConfig, device: torch.device, bundle: ModelBundle, objective: Objective,
                 data: DatasetView) -> None:
        import lpips

        path = backbone_weights_file(config.perceptual_net)
        self.real = path.is_file() or not config.local_files_only  # torchvision downloads when allowed
        self.config = config
        self.bundle, self.objective, self.data = bundle, objective, data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision's 'pretrained is deprecated' chatter
            # With the file in the cache torchvision loads it from there and never touches the network.
            self.net = lpips.LPIPS(net=config.perceptual_net, pnet_rand=not self.real, verbose=False)
        self.net = self.net.to(device).eval().requires_grad_(False)
        if self.real:
            self.description = (f"Perceptual regulariser on: LPIPS ({config.perceptual_net}, backbone weights from "
                                f"{path}), lambda {config.perceptual_lambda}.")
        else:
            self.description = (f"LPIPS backbone weights {path.name} are not in {path.parent}, so the perceptual term "
                                f"uses a RANDOM {config.perceptual_net} backbone (perceptual_random_backbone): it is "
                                "NOT the LPIPS perceptual metric.")
        self.total = 0.0
        self.count = 0

    def chosen_rows(self, step: int, timesteps: torch.Tensor) -> list[int]:
        """Rows of one sampler batch that get the term at optimizer step `step + 1`: the first
        `perceptual_batch` noised below `perceptual_timestep_max`. Chosen per sampler batch, before it is split
        into micro-batches, so an OOM halving changes who gets the term not at all."""
        config = self.config
        if (step + 1) % config.perceptual_every:
            return []
        return torch.nonzero(timesteps < config.perceptual_timestep_max).flatten()[: config.perceptual_batch].tolist()

    def term(self, batch: dict[str, Any], rows: slice, chosen: list[int], pred: torch.Tensor,
             noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """lambda x the sum of LPIPS over the `chosen` rows (indices in the sampler batch, all inside `rows`);
        `pred`, `noisy` and `timesteps` are the micro-batch's. The loop divides by the step's chosen count."""
        local = [i - rows.start for i in chosen]
        bundle = self.bundle
        x0 = self.objective.predicted_clean(noisy[local], pred[local], timesteps[local])
        # Outside autocast: the VAE is kept in fp32 in fp16 runs exactly so that this decode does not overflow.
        with torch.autocast(x0.device.type, enabled=False):
            decoded = bundle.family.decode_latents(bundle, x0).float()
            target = self.training_pixels(batch, rows, local).to(decoded.device)
            expected = tuple(d * bundle.family.latent_downscale(bundle) for d in x0.shape[-2:])
            if tuple(target.shape[-2:]) != expected:  # never assume the VAE scale: ask the bundle
                target = torch.nn.functional.interpolate(target, size=expected, mode="bilinear", antialias=True)
            distance = self.net(decoded, target, normalize=False).flatten()  # both in [-1, 1]
        self.total += float(distance.detach().sum())
        self.count += distance.numel()
        return self.config.perceptual_lambda * distance.sum()

    def training_pixels(self, batch: dict[str, Any], rows: slice, chosen: list[int]) -> torch.Tensor:
        """The training images of the chosen rows in [-1, 1]; with cached latents, their center crop (what
        the cache encoded)."""
        if "pixel_values" in batch:
            return batch["pixel_values"][rows][chosen].float()
        indices = batch["index"][rows]
        return torch.stack([self.data.center_pixel_values(indices[i]) for i in chosen]).float()

    def take_mean(self) -> float | None:
        """Mean LPIPS since the last call (None when the term was not computed)."""
        if not self.count:
            return None
        mean = self.total / self.count
        self.total, self.count = 0.0, 0
        return mean
