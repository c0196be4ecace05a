"""Issue 23, part 1, items 1, 3 and 5: the FLUX.2 Klein family loads a diffusers folder and the single files users
download (ComfyUI's layout) alike, encodes text exactly as Flux2KleinPipeline, refuses bad input in one sentence,
runs the real pipeline on a tiny real-layout model built offline, and says whether it was given the distilled
model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flux2_tools import one_sentence, tiny_klein_paths
from stabletune_core.models import ModelLoadError, detect_family, get_family
from stabletune_core.models.flux2_klein.family import KLEIN_PROMPT, Distillation, detect_distillation


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


@pytest.fixture(scope="module")
def folder_bundle(paths):
    return get_family("flux2_klein").load(paths["folder"])


@pytest.fixture(scope="module")
def file_bundle(paths):
    return get_family("flux2_klein").load(paths["transformer"], config_dir=paths["config"])


# ---- item 1: the family, its detection and its two sources -----------------------------------------------------
def test_family_is_registered_and_detected(paths, tiny_model, tmp_path):
    family = get_family("flux2_klein")
    assert (family.name, family.display_name, family.denoiser_name) == ("flux2_klein", "FLUX.2 Klein", "transformer")
    assert detect_family(paths["folder"]) == detect_family(paths["transformer"]) == "flux2_klein"
    assert detect_family(tiny_model) == "sd1"  # the SD families are detected as before
    from stabletune_core.models.sd.tiny import build_tiny_sdxl_single_file

    assert detect_family(build_tiny_sdxl_single_file(tmp_path / "xl.safetensors")) == "sdxl"


def test_single_files_load_exactly_as_the_folder(folder_bundle, file_bundle):
    for a, b in [(folder_bundle.denoiser, file_bundle.denoiser), (folder_bundle.vae, file_bundle.vae),
                 (folder_bundle.text_encoders[0], file_bundle.text_encoders[0])]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), type(a).__name__
    assert not any(p.requires_grad for p in file_bundle.denoiser.parameters())  # frozen until LoRA is added
    # ComfyUI's bundled tokenizer carries Qwen2.5's template (a default system turn): Klein's replaces it
    assert file_bundle.extra["chat_template_replaced"] and not folder_bundle.extra["chat_template_replaced"]
    prompts = ["a red circle", "a small purple star on a white background"]
    with torch.no_grad():
        a = folder_bundle.family.encode_text(folder_bundle, prompts)["prompt_embeds"]
        b = file_bundle.family.encode_text(file_bundle, prompts)["prompt_embeds"]
    assert torch.equal(a, b)


def test_encode_text_is_the_pipelines(folder_bundle, one_thread):
    from diffusers import Flux2KleinPipeline

    family, tok = folder_bundle.family, folder_bundle.tokenizers[0]
    prompts = ["a red circle", "a dog holding a sign", ""]
    with torch.no_grad():
        ours = family.encode_text(folder_bundle, prompts)["prompt_embeds"]
        theirs = Flux2KleinPipeline._get_qwen3_prompt_embeds(folder_bundle.text_encoders[0], tok, prompts)
    assert torch.equal(ours, theirs)
    assert ours.shape == (3, 512, 3 * 16)  # 512 tokens, hidden layers 9, 18, 27 side by side
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False) == KLEIN_PROMPT.format("x")
    cond = family.make_conditioning(folder_bundle, {"prompt_embeds": ours})
    assert torch.equal(cond.added_cond_kwargs["txt_ids"], Flux2KleinPipeline._prepare_text_ids(ours))
    assert "guidance" not in cond.added_cond_kwargs  # Klein has no guidance embedding
    two = cond.index(slice(0, 2)).to("cpu", torch.bfloat16)
    assert two.encoder_hidden_states.dtype == torch.bfloat16 and two.added_cond_kwargs["txt_ids"].dtype == torch.int64
    assert two.added_cond_kwargs["txt_ids"].shape == (2, 512, 4)


def test_pipeline_runs_end_to_end_on_the_tiny_model(folder_bundle, one_thread):
    pipe = folder_bundle.family.make_pipeline(folder_bundle)
    images = pipe(prompt=["a red circle"], height=64, width=64, num_inference_steps=3, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
    assert pipe.transformer is folder_bundle.denoiser  # the bundle's own modules, no copies


def test_tiny_model_is_deterministic_from_its_seed():
    from stabletune_core.models.flux2_klein.tiny import build_tiny_klein_components

    a, b, c = (build_tiny_klein_components(seed) for seed in (0, 0, 1))
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, sc = a[name].state_dict(), b[name].state_dict(), c[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert not all(torch.equal(sa[k], sc[k]) for k in sa), name
    assert a["tokenizer"].get_vocab() == c["tokenizer"].get_vocab()


# ---- item 1: bad input, one sentence each ------------------------------------------------------------------------
def refused(source, **kw) -> str:
    with pytest.raises(ModelLoadError) as err:
        get_family("flux2_klein").load(source, **kw)
    message = str(err.value)
    assert one_sentence(message), message
    return message


def test_missing_text_encoder_vae_or_tokenizer(paths, tmp_path):
    lonely = tmp_path / "models" / "diffusion_models" / paths["transformer"].name
    lonely.parent.mkdir(parents=True)
    shutil.copy(paths["transformer"], lonely)
    assert "needs its Qwen3 text encoder" in refused(lonely, config_dir=paths["config"])
    assert "needs the FLUX.2 VAE" in refused(lonely, config_dir=paths["config"], text_encoder=paths["text_encoder"])
    assert "needs the Qwen3 tokenizer" in refused(lonely, config_dir=paths["config"],
                                                   text_encoder=paths["text_encoder"], vae=paths["vae"])
    folder = tmp_path / "no-te"
    shutil.copytree(paths["folder"], folder, ignore=shutil.ignore_patterns("text_encoder"))
    assert "has no text_encoder/ folder" in refused(folder)


def test_tokenizer_that_does_not_match_the_text_encoder(paths, tmp_path):
    from stabletune_core.models.tokenizer import write_clip_tokenizer_files
    from stabletune_core.models.flux2_klein.tiny import build_tiny_tokenizer

    clip = write_clip_tokenizer_files(tmp_path / "clip")  # a CLIP tokenizer: no chat tokens
    (clip / "tokenizer_config.json").write_text(json.dumps({**json.loads((clip / "tokenizer_config.json").read_text()),
                                                            "tokenizer_class": "Qwen2Tokenizer"}))
    assert "does not match the Qwen3 text encoder" in refused(paths["transformer"], config_dir=paths["config"],
                                                              tokenizer=clip)
    big = build_tiny_tokenizer()
    big.add_tokens([f"<extra_{i}>" for i in range(200)])  # more tokens than the encoder embeds
    big.save_pretrained(str(tmp_path / "big"))
    message = refused(paths["folder"], tokenizer=tmp_path / "big")
    assert "has 602 tokens but the encoder embeds only 448" in message


def test_wrong_files_for_klein(paths, tmp_path):
    from stabletune_core.models.sd.tiny import build_tiny_sd1_single_file

    sd = build_tiny_sd1_single_file(tmp_path / "sd15.safetensors")
    assert "is a Stable Diffusion checkpoint, not FLUX.2 Klein" in refused(sd)
    pickle = tmp_path / "flux-2-klein-4b.ckpt"
    pickle.write_bytes(b"not really")
    assert "pickles" in refused(pickle)
    assert "is not a Qwen3 text encoder" in refused(paths["transformer"], config_dir=paths["config"],
                                                    text_encoder=paths["vae"])
    assert "is not the FLUX.2 VAE" in refused(paths["transformer"], config_dir=paths["config"],
                                              vae=paths["text_encoder"])
    assert "pass model_config_dir" in refused(paths["transformer"])  # tiny widths match no shipped config


def test_flux2_dev_is_not_klein(tmp_path):
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    from stabletune_core.models.flux2_klein.single_file import transformer_to_bfl
    from stabletune_core.models.flux2_klein.tiny import TRANSFORMER_CONFIG

    dev = Flux2Transformer2DModel(**{**TRANSFORMER_CONFIG, "guidance_embeds": True})
    save_file(transformer_to_bfl(dev.state_dict()), str(tmp_path / "flux2-dev.safetensors"))
    assert "is FLUX.2 [dev]" in refused(tmp_path / "flux2-dev.safetensors")


def test_klein_given_to_an_sd_family_is_refused(paths, tmp_path):
    from stabletune_core.config import build_config
    from stabletune_core.models.loading import load_model

    for source in (paths["folder"], paths["transformer"]):
        config = build_config(dict(pretrained_model_name_or_path=str(source), model_family="sdxl",
                                   output_dir=str(tmp_path / "run"), train_data_dir=str(tmp_path)))
        with pytest.raises(ModelLoadError) as err:
            load_model(config)
        assert "is a FLUX.2 Klein model, but model_family is sdxl" in str(err.value)
        assert one_sentence(str(err.value))


# ---- item 5: distilled or base -----------------------------------------------------------------------------------
def test_distilled_klein_is_named_before_training(paths, folder_bundle, tmp_path):
    family = get_family("flux2_klein")
    distilled = family.load(paths["distilled_folder"])
    note = family.distillation_note(distilled)
    assert note and one_sentence(note) and "step-distilled FLUX.2 Klein 4B" in note
    assert "is_distilled: true" in note and "flux-2-klein-base-4b.safetensors" in note
    assert "preview_model" in note  # the separate preview model the loop offers
    assert family.distillation_note(folder_bundle) is None  # the base model: nothing to say
    assert family.make_pipeline(distilled).config.is_distilled  # and its previews sample as distilled
    assert detect_distillation(tmp_path / "flux-2-klein-9b.safetensors").verdict == "distilled"
    assert detect_distillation(tmp_path / "flux-2-klein-base-9b.safetensors").verdict == "base"
    unknown = detect_distillation(tmp_path / "my_finetune.safetensors")
    assert unknown.verdict == "unknown" and one_sentence(unknown.sentence("9b"))
    assert detect_distillation(tmp_path / "x.safetensors", {"modelspec.title": "FLUX.2 klein base 4B"}).verdict == "base"
    assert Distillation("base", "").sentence() is None


def test_the_files_beside_a_comfyui_transformer_are_found_past_decoys(paths, tmp_path):
    """One finder (the twin text-encoder and VAE finders merged) reads only headers and takes the first file that
    fits: a Qwen3 of another width and an SD VAE sorted before the right files are passed over."""
    from safetensors.torch import save_file

    from stabletune_core.models.flux2_klein.family import _find_beside, _is_flux2_vae, _is_qwen3_of_width

    comfy = tmp_path / "ComfyUI"
    transformer = comfy / "models" / "diffusion_models" / paths["transformer"].name
    for folder, right in (("text_encoders", paths["text_encoder"]), ("vae", paths["vae"])):
        (comfy / "models" / folder).mkdir(parents=True)
        shutil.copy(right, comfy / "models" / folder / f"z_{right.name}")
    transformer.parent.mkdir(parents=True)
    shutil.copy(paths["transformer"], transformer)
    wide = {"model.layers.0.self_attn.q_norm.weight": torch.zeros(8),
            "model.layers.0.post_attention_layernorm.weight": torch.zeros(4096)}
    save_file(wide, comfy / "models" / "text_encoders" / "a_qwen_3_8b.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, comfy / "models" / "vae" / "a_sd_vae.safetensors")
    hidden = get_family("flux2_klein").load(paths["folder"]).text_encoders[0].config.hidden_size
    assert _find_beside(transformer, "text_encoders", _is_qwen3_of_width(hidden)).name.startswith("z_")
    assert _find_beside(transformer, "vae", _is_flux2_vae).name.startswith("z_")
    assert _find_beside(tmp_path / "elsewhere.safetensors", "vae", _is_flux2_vae) is None  # not in a ComfyUI


def test_doctor_counts_captions_with_the_klein_prompt(paths, tmp_path, capsys):
    """`doctor` on a Klein model asks the family how its text encoder reads captions (the Qwen3 chat prompt,
    512 tokens) instead of loading CLIP tokenizers from it, which failed with a traceback; without a Klein model
    there is no tokenizer to count with, and it says so in one sentence."""
    from PIL import Image

    from stabletune_core.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for name, caption, colour in (("short", "a red circle", (200, 30, 30)), ("long", "red " * 600, (30, 30, 200))):
        Image.new("RGB", (64, 64), colour).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(caption)
    report_file = tmp_path / "report.json"
    assert main(["doctor", str(data), "--model", str(paths["folder"]), "--family", "flux2_klein", "--resolution",
                 "64", "--json", str(report_file)]) == 0
    captions = json.loads(report_file.read_text())["captions"]
    assert captions["limit"] == 512 and "Qwen3 tokenizer" in captions["tokenizer"]
    assert [Path(c["path"]).name for c in captions["too_long"]] == ["long.png"]
    tokens = {Path(i["path"]).name: i["tokens"] for i in json.loads(report_file.read_text())["items"]}
    assert 10 < tokens["short.png"] < 40  # the caption inside the chat template's turns
    capsys.readouterr()
    assert main(["doctor", str(data), "--family", "flux2_klein", "--resolution", "64"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("error: ")
    assert "needs Qwen3's tokenizer" in error and one_sentence(error)


def test_doctor_counts_klein_captions_against_the_runs_max_sequence_length(paths, tmp_path, capsys):
    """A Klein run that pads its prompts to max_sequence_length tokens reads no more of a caption than that, so
    the doctor counts captions against the run's length (its config's, or --max_sequence_length), not the
    pipeline's 512; the length is checked as a run checks it, in the run's own sentence."""
    from PIL import Image

    from stabletune_core.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for name, caption in (("short", "a red circle"), ("wordy", "a red circle " * 12)):
        Image.new("RGB", (64, 64), (200, 30, 30)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(caption)
    config = tmp_path / "run.toml"
    config.write_text(f'model_family = "flux2_klein"\npretrained_model_name_or_path = "{paths["folder"].as_posix()}"\n'
                      f'train_data_dir = "{data.as_posix()}"\nresolution = 64\nbucket_step = 16\n'
                      'min_bucket_reso = 32\nmax_sequence_length = 32\n')

    def captions(*args: str) -> dict:
        report = tmp_path / "report.json"
        assert main(["doctor", *args, "--json", str(report)]) == 0
        return json.loads(report.read_text())["captions"]

    from_config = captions("--config", str(config))
    assert from_config["limit"] == 32
    assert [Path(c["path"]).name for c in from_config["too_long"]] == ["wordy.png"]  # 512 would let it pass
    assert captions("--config", str(config), "--max_sequence_length", "64")["limit"] == 64
    assert captions(str(data), "--model", str(paths["folder"]), "--resolution", "64")["limit"] == 512
    capsys.readouterr()
    assert main(["doctor", str(data), "--family", "sd1", "--resolution", "64", "--max_sequence_length", "32"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("error: ")
    assert error.startswith("max_sequence_length is set to 32, but it belongs to FLUX.2 Klein") and one_sentence(error)
