"""Issue 39 item 7: Z-Image in the UI: the family in the picker with its presets, Check settings judging a detected
Z-Image (folder or single file, read without torch), a preset of another family clearing a Z-Image model, and the
A1111/Forge tab saying which programs load a Z-Image LoRA (it is not copied into the WebUI's Lora folder).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from test_ui_parts import raw_form, ui  # noqa: F401  (the whole UI built in-process, as the UI tests use it)
from test_z_image import folders  # noqa: F401 (the module-scoped tiny model)
from stabletune_core.config import build_config, read_toml

ROOT = Path(__file__).resolve().parent.parent
Z_IMAGE_PRESETS = sorted((ROOT / "presets").glob("z_image*.toml"))


@pytest.fixture(scope="module")
def single_file(folders, tmp_path_factory) -> Path:
    from diffusers import ZImageTransformer2DModel

    from stabletune_core.models.z_image.single_file import transformer_to_original

    state = ZImageTransformer2DModel.from_pretrained(str(folders["base"] / "transformer")).state_dict()
    file = tmp_path_factory.mktemp("diffusion_models") / "z_image_turbo_bf16.safetensors"
    save_file(transformer_to_original(state), str(file))
    return file


def test_z_image_presets_are_valid_and_train_z_image():
    assert [p.stem for p in Z_IMAGE_PRESETS] == ["z_image-12gb", "z_image-16gb", "z_image-24gb", "z_image-8gb",
                                                "z_image-base", "z_image-turbo-adapter"]
    for preset in Z_IMAGE_PRESETS:
        values = read_toml(preset)
        config = build_config(values)
        assert config.model_family == "z_image" and "pretrained_model_name_or_path" not in values
        assert "preview_model" in preset.read_text()  # each says how to preview on Turbo
    assert "training_adapter" in Z_IMAGE_PRESETS[-1].read_text()


def test_the_family_is_detected_without_torch(folders, single_file, tmp_path):
    from extension.validation import family_mismatch, transformer_family

    assert transformer_family({"pretrained_model_name_or_path": str(folders["base"])}) == "z_image"
    assert transformer_family({"pretrained_model_name_or_path": str(single_file)}) == "z_image"
    assert transformer_family({"pretrained_model_name_or_path": str(folders["base"]), "model_family": "sd1"}) is None
    vae = tmp_path / "ae.safetensors"
    save_file({"decoder.conv_in.weight": __import__("torch").zeros(2, 2)}, str(vae))
    assert transformer_family({"pretrained_model_name_or_path": str(vae)}) is None
    [problem] = family_mismatch({"pretrained_model_name_or_path": str(single_file), "model_family": "flux2_klein"})
    assert "is a Z-Image model but model_family is flux2_klein" in problem


def test_the_picker_offers_z_image_and_check_settings_judges_it(ui, folders, shapes_dataset,  # noqa: F811
                                                                tmp_path):
    from extension import presets
    from extension.tabs import model as model_tab

    assert "z_image" in ui.form.fields["model_family"]["choices"]
    assert {p.stem for p in Z_IMAGE_PRESETS} <= set(presets.list_all(ui.settings.preset_folders))
    common = dict(pretrained_model_name_or_path=str(folders["base"]), train_data_dir=str(shapes_dataset),
                  output_dir=str(tmp_path / "run"))
    assert "Settings are valid" in model_tab._check(ui, *raw_form(ui, model_family="z_image", **common))[0]
    auto = model_tab._check(ui, *raw_form(ui, snr_gamma=5.0, **common))[0]  # detected: the engine would refuse
    assert "Fix these before starting" in auto and "SNR gamma" in auto and "on Z-Image" in auto, auto
    dora = model_tab._check(ui, *raw_form(ui, use_dora=True, **common))[0]
    assert "This DoRA file does not load in diffusers" in dora, dora
    assert model_tab.family_changed({"model_family": "sdxl", "pretrained_model_name_or_path": str(folders["base"])},
                                    {"pretrained_model_name_or_path": str(folders["base"])})
    assert not model_tab.family_changed({"model_family": "z_image",
                                         "pretrained_model_name_or_path": str(folders["base"])},
                                        {"pretrained_model_name_or_path": str(folders["base"])})


def test_the_webui_tab_says_which_programs_load_a_z_image_lora(folders, tmp_path):
    from extension import webui
    from stabletune_core.config import TrainConfig

    run = tmp_path / "zrun"
    run.mkdir()
    TrainConfig(pretrained_model_name_or_path=str(folders["turbo"]), output_name="zlora",
                output_dir=str(run)).save_toml(run / "config.toml")
    note = webui.host_note(run, webui.trained_transformer_family(run))
    assert note.startswith("Z-Image trains here") and "AUTOMATIC1111 and Forge cannot load Z-Image LoRAs" in note
    assert "ZImagePipeline.load_lora_weights" in note and "zlora.safetensors" in note and "ComfyUI" in note
    assert webui.run_note(run) == note  # the status line says it too, and nothing is copied
