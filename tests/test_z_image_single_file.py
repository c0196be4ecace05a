"""Issue 39 item 2 (single files): Z-Image from the one transformer file users download (ComfyUI's
``models/diffusion_models/z_image_turbo_bf16.safetensors``, Tongyi-MAI's original key names), its text encoder, VAE
and tokenizer from a Z-Image diffusers folder named by model_config_dir; detected from its keys; bad input in one
sentence. The tiny real-layout Z-Image is written in the original layout by our converter and read back.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flux2_tools import one_sentence
from test_flux2_training import cli, small_args
from test_z_image import failed_in_one_sentence, folders, output  # noqa: F401 (the module-scoped tiny model)
from stabletune_core.models import detect_family, get_family
from stabletune_core.models.base import ModelLoadError
from stabletune_core.models.z_image.single_file import (FULL_CHECKPOINT_PREFIX, file_layout, transformer_from_original,
                                                        transformer_to_original)
from stabletune_core.runs.reader import RunReader


def transformer_state(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel.from_pretrained(str(folder / "transformer"), local_files_only=True).state_dict()


@pytest.fixture(scope="module")
def comfy_file(folders, tmp_path_factory) -> Path:
    """The tiny Z-Image's transformer where ComfyUI keeps it, in the original layout, named as the Turbo file."""
    where = tmp_path_factory.mktemp("ComfyUI") / "models" / "diffusion_models"
    where.mkdir(parents=True)
    file = where / "z_image_turbo_bf16.safetensors"
    save_file(transformer_to_original(transformer_state(folders["base"])), str(file))
    return file


def test_our_original_layout_is_the_one_diffusers_converter_reads(folders):
    """diffusers' own convert_z_image_transformer_checkpoint_to_diffusers turns what we write back into the model's
    keys and tensors, and so does ours; the file has ComfyUI's names (fused qkv, out, q_norm, x_embedder)."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    state = transformer_state(folders["base"])
    original = transformer_to_original(state)
    assert "layers.0.attention.qkv.weight" in original and "x_embedder.weight" in original
    assert "final_layer.linear.weight" in original and "noise_refiner.1.attention.out.weight" in original
    assert not any(".to_q." in k or "all_" in k or "norm_q" in k for k in original)
    for converted in (convert_z_image_transformer_checkpoint_to_diffusers(dict(original)),
                      transformer_from_original(original)):
        assert converted.keys() == state.keys() and all(torch.equal(converted[k], state[k]) for k in state)
    assert file_layout(original) == "original" and file_layout(state) == "diffusers"


@pytest.mark.parametrize("prefixed", [False, True], ids=["diffusion_models-file", "full-checkpoint-keys"])
def test_a_single_file_loads_with_its_companions_and_computes_the_same(folders, comfy_file, prefixed, tmp_path,
                                                                       one_thread):
    file = comfy_file
    if prefixed:  # an all-in-one checkpoint's transformer keys sit under model.diffusion_model.
        from safetensors.torch import load_file

        file = tmp_path / "z_image_turbo_full.safetensors"
        save_file({FULL_CHECKPOINT_PREFIX + k: v for k, v in load_file(str(comfy_file)).items()}, str(file))
    assert detect_family(file) == "z_image"
    bundle = get_family("z_image").load(file, config_dir=folders["base"])
    folder_bundle = get_family("z_image").load(folders["base"])
    assert torch.equal(output(bundle.denoiser), output(folder_bundle.denoiser))
    assert bundle.extra["source_kind"] == "file" and bundle.extra["distillation"].verdict == "distilled"
    text = bundle.family.encode_text(bundle, ["a red circle"])
    assert torch.equal(text["prompt_embeds"], folder_bundle.family.encode_text(folder_bundle,
                                                                               ["a red circle"])["prompt_embeds"])


def test_trains_from_the_single_file_on_the_command_line(folders, comfy_file, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(comfy_file, shapes_dataset, run, model_config_dir=folders["base"], max_train_steps=2))
    assert done.returncode == 0, done.stderr[-3000:]
    assert RunReader(run).status()["state"] == "finished"
    assert "Z-Image-Turbo" in done.stderr  # the file's name says Turbo: the sentence before training
    assert (run / "output" / "lora.safetensors").is_file()


# ---- bad input, one sentence each ---------------------------------------------------------------------------------
def test_a_single_file_without_its_companion_folder_fails_in_one_sentence(comfy_file, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(comfy_file, shapes_dataset, run, max_train_steps=1))
    failed_in_one_sentence(done, run, "model_config_dir", "text encoder")


def test_a_z_image_file_forced_to_another_family_fails_in_one_sentence(comfy_file, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(comfy_file, shapes_dataset, run, model_family="flux2_klein", max_train_steps=1))
    failed_in_one_sentence(done, run, "Z-Image", "model_family", "z_image")


def companion_copy(folders, tmp_path: Path, drop: str | None = None, text_width: int | None = None) -> Path:
    folder = Path(shutil.copytree(folders["base"], tmp_path / "Z-Image-companions"))
    if drop:
        shutil.rmtree(folder / drop)
    if text_width:  # a Qwen3 of another width than the transformer reads
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config.from_pretrained(str(folder / "text_encoder"))
        config.hidden_size, config.head_dim = text_width, text_width // config.num_attention_heads
        Qwen3ForCausalLM(config).save_pretrained(str(folder / "text_encoder"))
    return folder


@pytest.mark.parametrize("case, words", [
    ("missing text encoder", ("text_encoder/", "model_config_dir")),
    ("mismatched text encoder", ("text encoder", "wide", "Qwen3-4B")),
    ("not a Z-Image folder", ("model_config_dir", "not a Z-Image")),
    ("not a Z-Image file", ("not a Z-Image transformer",)),
    ("another Z-Image's config", ("does not fit",)),
])
def test_bad_companions_are_one_sentence(case, words, folders, comfy_file, tmp_path, one_thread):
    file, companions = comfy_file, folders["base"]
    if case == "missing text encoder":
        companions = companion_copy(folders, tmp_path, drop="text_encoder")
    elif case == "mismatched text encoder":
        companions = companion_copy(folders, tmp_path, text_width=24)
    elif case == "not a Z-Image folder":
        companions = tmp_path
    elif case == "not a Z-Image file":
        file = tmp_path / "vae.safetensors"
        save_file({"decoder.conv_in.weight": torch.zeros(2, 2)}, str(file))
    else:  # the file is a 2-layer transformer; the folder's config says 3
        import json

        companions = companion_copy(folders, tmp_path)
        config = json.loads((companions / "transformer" / "config.json").read_text())
        (companions / "transformer" / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    with pytest.raises(ModelLoadError) as caught:
        get_family("z_image").load(file, config_dir=companions)
    message = str(caught.value)
    assert one_sentence(message) and all(w in message for w in words), message
