"""Issue 39 item 2 (the ways out of Turbo's distillation): a training adapter the user supplies (training_adapter)
is merged into Z-Image while training, exactly as diffusers' ZImagePipeline.load_lora_weights applies it, and left
out of the exported LoRA and of the preview model; one that does not fit, or on another family, is one sentence.
Training on Base with Turbo as preview_model is proven in tests/test_z_image.py (the `trained` fixture).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux2_tools import one_sentence
from test_flux2_training import cli, events_of, small_args
from test_z_image import failed_in_one_sentence, folders, load, output  # noqa: F401 (the module-scoped tiny model)
from stabletune_core.config import build_config
from stabletune_core.models.z_image.family import LORA_PRESETS
from stabletune_core.runs.reader import RunReader

TOLERANCE = 1e-5


def adapted_z_image(folder: Path, targets: list[str], network: str = "lora", rank: int = 4, alpha: float = 2.0,
                    seed: int = 0):
    """A fresh tiny Z-Image with trained-looking (non-zero, deterministic) adapters of `network`."""
    from stabletune_core.lora.inject import add_lora

    bundle = load(folder)
    dora = network == "dora"
    add_lora(bundle, build_config(dict(model_family="z_image", unet_lora_targets=targets, lora_rank=rank,
                                       lora_alpha=alpha, network_type="lora" if dora else network, use_dora=dora)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bundle.denoiser.parameters():
            if p.requires_grad:
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    bundle.denoiser.eval()
    return bundle


@pytest.fixture(scope="module")
def adapter_file(folders, tmp_path_factory) -> Path:
    """A training adapter over attention and MLP (the run below trains attention only), kohya names, alpha 2 of
    rank 4, as a user would download one."""
    from stabletune_core.lora.export import export_kohya_lora

    bundle = adapted_z_image(folders["turbo"], LORA_PRESETS["attention_mlp"], seed=7)
    file = tmp_path_factory.mktemp("adapter") / "zimage_turbo_training_adapter_tiny.safetensors"
    return export_kohya_lora(file, bundle.denoiser, None, bundle.family, rank=4, alpha=2.0, dtype=torch.float32)


def test_the_merged_adapter_computes_what_diffusers_loader_applies(folders, adapter_file, one_thread):
    from diffusers import ZImagePipeline

    from stabletune_core.models.loading import load_model

    config = build_config(dict(pretrained_model_name_or_path=str(folders["turbo"]), model_family="z_image",
                               training_adapter=str(adapter_file)))
    merged = load_model(config)
    pipe = ZImagePipeline.from_pretrained(str(folders["turbo"]), local_files_only=True)
    base = output(pipe.transformer)
    pipe.load_lora_weights(str(adapter_file))
    theirs = output(pipe.transformer)
    assert (theirs - base).abs().max() > 100 * TOLERANCE  # the adapter acts
    assert (output(merged.denoiser) - theirs).abs().max() <= TOLERANCE
    assert not any("lora" in name for name, _ in merged.denoiser.named_parameters())  # merged, not an adapter module
    notes = merged.family.load_notes(merged)
    assert any("training adapter" in n and adapter_file.name in n for n in notes)
    assert not any("blur" in n for n in notes)  # the adapter is the way out the Turbo sentence names


@pytest.fixture(scope="module")
def runs(folders, adapter_file, shapes_dataset, tmp_path_factory) -> dict[str, Path]:
    """The same 2-step run on Turbo with and without the training adapter."""
    root = tmp_path_factory.mktemp("z-image-adapter-runs")
    out = {}
    for name, extra in (("with", dict(training_adapter=adapter_file)), ("without", {})):
        run = root / name
        done = cli(*small_args(folders["turbo"], shapes_dataset, run, max_train_steps=2, **extra))
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = run
    return out


def test_exported_lora_holds_only_the_trained_adapter(runs, adapter_file):
    with_adapter, without = (load_file(runs[n] / "output" / "lora.safetensors") for n in ("with", "without"))
    adapter = load_file(adapter_file)
    assert any(".feed_forward." in k for k in adapter)  # the training adapter adapts the MLP too
    assert with_adapter.keys() == without.keys()  # the run's own layers (attention), nothing of the adapter's
    assert not any(".feed_forward." in k for k in with_adapter)
    steps = {n: [m["loss"] for m in RunReader(runs[n]).metrics()] for n in runs}
    assert steps["with"] != steps["without"]  # the adapter was in the model while it trained
    note = next(e["message"] for e in events_of(runs["with"], "model") if "training adapter" in e["message"])
    assert one_sentence(note) and adapter_file.name in note and "left out of the exported LoRA" in note


def test_a_training_adapter_of_the_wrong_shape_fails_in_one_sentence(folders, shapes_dataset, tmp_path):
    wrong = tmp_path / "adapter_for_a_wider_model.safetensors"
    name = "diffusion_model.layers.0.attention.to_q"
    save_file({f"{name}.lora_down.weight": torch.randn(4, 48), f"{name}.lora_up.weight": torch.randn(48, 4),
               f"{name}.alpha": torch.tensor(4.0)}, str(wrong))
    run = tmp_path / "run"
    done = cli(*small_args(folders["turbo"], shapes_dataset, run, training_adapter=wrong, max_train_steps=1))
    failed_in_one_sentence(done, run, "training_adapter", wrong.name, "does not fit")


def test_a_training_adapter_that_is_no_lora_fails_in_one_sentence(folders, shapes_dataset, tmp_path):
    other = tmp_path / "not_an_adapter.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(2, 2)}, str(other))
    run = tmp_path / "run"
    done = cli(*small_args(folders["turbo"], shapes_dataset, run, training_adapter=other, max_train_steps=1))
    failed_in_one_sentence(done, run, "training_adapter", other.name)


@pytest.mark.parametrize("family", ["sd1", "flux2_klein"])
def test_a_training_adapter_on_another_family_is_refused_before_loading(family, folders, adapter_file,
                                                                       shapes_dataset, tmp_path):
    run = tmp_path / "run"  # the config refuses it before the model (here a Z-Image under that family) is looked at
    done = cli(*small_args(folders["base"], shapes_dataset, run, model_family=family, training_adapter=adapter_file,
                           max_train_steps=1))
    failed_in_one_sentence(done, run, "training_adapter", "leave it empty")
    assert "Loading" not in done.stderr


def test_a_missing_training_adapter_is_refused_before_loading(folders, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(folders["turbo"], shapes_dataset, run, training_adapter=tmp_path / "gone.safetensors",
                           max_train_steps=1))
    message = failed_in_one_sentence(done, run, "training_adapter")
    assert "Loading" not in done.stderr, message
