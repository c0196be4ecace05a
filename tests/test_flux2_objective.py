"""Issue 23, part 1, item 2: the flow-matching objective draws, noises, targets and weights exactly as diffusers'
Klein LoRA script (its training_utils functions and the scheduler's table), and Klein's latent normalisation is
the pipeline's own."""
from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from flux2_tools import tiny_klein_paths
from stabletune_core.config import build_config
from stabletune_core.models.flow_matching import FlowMatching
from stabletune_core.models.flux2_klein.family import SHIPPED_CONFIGS


def example_sigmas(scheduler, timesteps):
    """train_dreambooth_lora_flux2_klein.py's get_sigmas."""
    schedule = scheduler.timesteps
    index = [(schedule == t).nonzero().item() for t in timesteps]
    return scheduler.sigmas[index].flatten()


@pytest.mark.parametrize("scheme", ["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"])
@pytest.mark.parametrize("shift, dynamic", [(1.0, False), (3.0, False), (3.0, True)])
def test_draws_and_weights_equal_diffusers(scheme, shift, dynamic):
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=dynamic)
    ours = FlowMatching.from_scheduler(scheduler.config, weighting_scheme=scheme, logit_mean=0.3, logit_std=1.2,
                                       mode_scale=1.29)
    table_t, table_s = ours.schedule()
    assert torch.equal(table_t, scheduler.timesteps) and torch.equal(table_s, scheduler.sigmas)

    u = compute_density_for_timestep_sampling(scheme, 64, logit_mean=0.3, logit_std=1.2, mode_scale=1.29,
                                              generator=torch.Generator().manual_seed(7))
    assert torch.equal(ours.draw_u(64, torch.Generator().manual_seed(7)), u)
    theirs = scheduler.timesteps[(u * 1000).long()]
    timesteps = ours.draw_timesteps(64, torch.Generator().manual_seed(7))
    assert torch.equal(timesteps, theirs)
    sigmas = example_sigmas(scheduler, timesteps)
    assert torch.equal(ours.sigmas(timesteps), sigmas)
    weight = ours.loss_weight(timesteps)  # None: all 1 (the Objective protocol's way to say so)
    weight = torch.ones_like(sigmas) if weight is None else weight
    assert torch.equal(weight, compute_loss_weighting_for_sd3(scheme, sigmas))
    assert torch.equal(ours.model_timestep(timesteps), timesteps / 1000)


def test_klein_scheduler_trains_unshifted_and_an_explicit_shift_wins():
    """Klein's scheduler shifts at sampling time (use_dynamic_shifting), so the training table is the plain one,
    as diffusers' script uses it; a user's explicit shift replaces that."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(SHIPPED_CONFIGS["4b"]), subfolder="scheduler")
    assert FlowMatching.from_scheduler(scheduler.config).shift == 1.0
    shifted = FlowMatching.from_scheduler({**scheduler.config, "use_dynamic_shifting": False})
    assert shifted.shift == 3.0 and shifted.schedule()[1][500] > FlowMatching().schedule()[1][500]
    with pytest.raises(ValueError, match="weighting_scheme must be one of"):
        FlowMatching(weighting_scheme="snr")


def test_noise_path_target_and_loss_are_the_examples():
    objective = FlowMatching(weighting_scheme="cosmap")
    latents = torch.randn(3, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    noisy, noise, timesteps = objective.add_noise(latents, torch.Generator().manual_seed(2))
    again = torch.Generator().manual_seed(2)  # the same generator state draws the same noise and timesteps
    assert torch.equal(noise, torch.randn(latents.shape, generator=again))
    assert torch.equal(timesteps, objective.draw_timesteps(3, again))
    sigmas = objective.sigmas(timesteps).view(-1, 1, 1, 1)
    assert torch.equal(noisy, (1.0 - sigmas) * latents + sigmas * noise)
    target = objective.target(latents, noise, timesteps)
    assert torch.equal(target, noise - latents)
    pred = target + 0.1 * torch.randn(target.shape, generator=torch.Generator().manual_seed(3))
    weighting = compute_loss_weighting_for_sd3("cosmap", sigmas)
    example = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(3, -1), 1)
    assert torch.equal(objective.loss(pred, target, timesteps), example)
    with pytest.raises(ValueError, match="not one of the training table"):
        objective.sigmas(torch.tensor([0.5]))


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    from stabletune_core.models import get_family

    return get_family("flux2_klein").load(tiny_klein_paths(tmp_path_factory)["folder"])


def test_latent_normalisation_is_the_pipelines(tiny_bundle, one_thread):
    family, vae = tiny_bundle.family, tiny_bundle.vae
    pipe = family.make_pipeline(tiny_bundle)
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_latents(tiny_bundle, pixels)
    with torch.no_grad():
        assert torch.equal(latents, pipe._encode_vae_image(pixels, generator=None))  # mode, patchify, batch norm
    assert latents.shape == (2, 16, 4, 4) and family.latent_downscale(tiny_bundle) == 16
    # the pipeline's own steps before vae.decode, written out as in Flux2KleinPipeline.__call__
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    from stabletune_core.models.flux2_klein.family import denormalize_latents

    assert torch.equal(denormalize_latents(vae, latents), pipe._unpatchify_latents(latents * std + mean))
    assert not torch.allclose(mean, torch.zeros_like(mean))  # the tiny VAE's statistics are not the identity


def test_predict_is_the_examples_transformer_call(tiny_bundle, one_thread):
    from diffusers import Flux2KleinPipeline

    family = tiny_bundle.family
    objective = family.objective(tiny_bundle, build_config(dict(model_family="flux2_klein",
                                                                weighting_scheme="logit_normal")))
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(4))
    noisy, noise, timesteps = objective.add_noise(latents, torch.Generator().manual_seed(5))
    with torch.no_grad():
        cond = family.encode_prompts(tiny_bundle, ["a red circle", "a blue square"])
        ours = objective.predict(tiny_bundle.denoiser, noisy, timesteps, cond)
        # train_dreambooth_lora_flux2_klein.py, lines "packed_noisy_model_input = ..." to "_unpack_latents_with_ids"
        ids = Flux2KleinPipeline._prepare_latent_ids(noisy)
        packed = Flux2KleinPipeline._pack_latents(noisy)
        prompt_embeds, text_ids = family.make_pipeline(tiny_bundle).encode_prompt(["a red circle", "a blue square"])
        pred = tiny_bundle.denoiser(hidden_states=packed, timestep=timesteps / 1000, guidance=None,
                                encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=ids,
                                return_dict=False)[0][:, : packed.size(1):]
        pred = Flux2KleinPipeline._unpack_latents_with_ids(pred, ids)
    assert torch.equal(ours, pred)
    assert ours.shape == latents.shape and torch.isfinite(ours).all()
