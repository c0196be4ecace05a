"""Issue 39 items 2-4 (core): Z-Image (Base and Turbo) as a family behind the same face, on a tiny real-layout Z-Image
built offline (models/z_image/tiny.py): loading and detection, the Qwen3 text path (the pipeline's own encoding),
training from the command line, the exported LoRA in diffusers' ZImagePipeline.load_lora_weights and under
ComfyUI's key rule, the Turbo sentence, bad input, NaN rollback and exact resume after SIGKILL.
"""
from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux2_tools import one_sentence
from test_flux2_training import cli, events_of, small_args
from stabletune_core.config import TrainConfig
from stabletune_core.config.families import Z_IMAGE_LORA_TARGETS
from stabletune_core.models.z_image.family import LORA_PRESETS
from stabletune_core.runs.reader import RunReader

TOLERANCE = 1e-5
_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """{"base": a tiny Z-Image folder named as Base, "turbo": the same model named as Turbo}."""
    if not _BUILT:
        import shutil

        from stabletune_core.models.z_image.tiny import build_tiny_z_image

        root = tmp_path_factory.mktemp("tiny-z-image")
        _BUILT["base"] = build_tiny_z_image(root / "Z-Image-tiny", seed=0)
        _BUILT["turbo"] = Path(shutil.copytree(_BUILT["base"], root / "Z-Image-Turbo-tiny"))
    return _BUILT


def load(folder: Path):
    from stabletune_core.models import get_family

    return get_family("z_image").load(folder)


# ---- the family: detection, targets, the text path -----------------------------------------------------------------
def test_lora_targets_are_the_familys_preset():
    assert Z_IMAGE_LORA_TARGETS == LORA_PRESETS["attention"]  # config/families.py cannot import the torch side


def test_a_z_image_folder_is_detected_and_its_text_is_the_pipelines(folders, one_thread):
    """detect_family names it; our encoding, cut by its mask, is ZImagePipeline._encode_prompt's, bit for bit."""
    from diffusers import ZImagePipeline

    from stabletune_core.models import detect_family

    assert detect_family(folders["base"]) == "z_image"
    bundle = load(folders["base"])
    prompts = ["a red circle", "a small blue square on a white background"]
    text = bundle.family.encode_text(bundle, prompts)
    pipe = ZImagePipeline.from_pretrained(str(folders["base"]), local_files_only=True)
    expected = pipe._encode_prompt(list(prompts), device=torch.device("cpu"))
    for row, want in enumerate(expected):
        got = text["prompt_embeds"][row][text["attention_mask"][row].bool()]
        assert got.shape == want.shape and torch.equal(got, want)



def test_a_captions_token_count_is_what_the_pipeline_encodes(folders, one_thread):
    """The doctor's caption length for Z-Image counts the tokens ZImagePipeline._encode_prompt keeps (its chat template
    with thinking on), not Klein's template (thinking off adds an empty think block: 19 tokens instead of 13)."""
    from diffusers import ZImagePipeline

    count, limit, where = load(folders["base"]).family.caption_tokens(folders["base"])
    pipe = ZImagePipeline.from_pretrained(str(folders["base"]), local_files_only=True)
    for caption in ("a red circle", "a small blue square on a white background, drawn twice"):
        assert count(caption) == pipe._encode_prompt([caption], device=torch.device("cpu"))[0].shape[0]
    assert limit > 0 and "tokenizer" in where

def test_our_velocity_is_the_pipelines_noise_prediction(folders, one_thread):
    """call_transformer (through the objective) gives what ZImagePipeline's loop feeds the scheduler at t."""
    from stabletune_core.config import build_config

    bundle = load(folders["base"])
    objective = bundle.family.objective(bundle, build_config({}))
    cond = bundle.family.encode_prompts(bundle, ["a red circle", "a cat"])
    noisy = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = objective.draw_timesteps(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = objective.predict(bundle.denoiser, noisy, t, cond)
        mask = cond.added_cond_kwargs["attention_mask"].bool()
        caps = [e[m] for e, m in zip(cond.encoder_hidden_states, mask)]
        out = bundle.denoiser(list(noisy.unsqueeze(2).unbind(0)), (1000 - t) / 1000, caps, return_dict=False)[0]
    # 1 - t / 1000 (ours) and (1000 - t) / 1000 (the pipeline's) round differently in the last bit
    pipeline = -torch.stack([o.float() for o in out]).squeeze(2)
    assert torch.allclose(ours, pipeline, rtol=0, atol=1e-5) and ours.abs().max() > 0.1


# ---- training from the command line, the export in diffusers and ComfyUI ----------------------------------------
@pytest.fixture(scope="module")
def trained(folders, shapes_dataset, tmp_path_factory):
    """One 4-step CLI run on the tiny Z-Image Base, family auto-detected, both export formats, validation images
    from Turbo (preview_model), the way out the Turbo sentence names."""
    run = tmp_path_factory.mktemp("z-image-cli") / "run"
    done = cli(*small_args(folders["base"], shapes_dataset, run, save_steps=2, export_diffusers_format=True,
                           validation_prompt="a red circle", validation_steps=4, validation_inference_steps=2,
                           num_validation_images=1, preview_model=folders["turbo"]))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done


def test_trains_from_the_command_line_and_exports_the_lora(trained):
    run, done = trained
    assert RunReader(run).status()["state"] == "finished"
    metrics = RunReader(run).metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(m["loss"]))
                                                              for m in metrics)
    events = events_of(run, "model")
    model = events[0]["message"]
    assert "Z-Image Base" in model and done.stderr.index(f"model: {model}") < done.stderr.index("training:")
    assert any(e.get("preview") and "Z-Image-Turbo" in e["message"] for e in events[1:])  # Turbo previews
    config = TrainConfig.from_toml(run / "config.toml")
    assert config.model_family in ("auto", "z_image") and config.unet_lora_targets == Z_IMAGE_LORA_TARGETS
    assert (run / "samples" / "step_000004" / "p00_s5.png").is_file()
    keys = load_file(run / "output" / "lora.safetensors")
    assert keys and all(k.startswith("diffusion_model.") for k in keys)
    assert any(".layers.0.attention.to_q." in k for k in keys) and any("noise_refiner" in k for k in keys)


def trained_bundle(folder: Path, run: Path, step: int):
    from stabletune_core.lora.inject import add_lora, load_lora_state_dict

    config = TrainConfig.from_toml(run / "config.toml")
    bundle = load(folder)
    add_lora(bundle, config)
    adapter = load_file(run / "checkpoints" / f"step_{step:06d}" / "adapter.safetensors")
    load_lora_state_dict(bundle.denoiser, {k.removeprefix("unet."): v for k, v in adapter.items()})
    bundle.denoiser.eval()
    return bundle


@torch.no_grad()
def output(transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = list(torch.randn(2, 4, 1, 8, 8, generator=g).unbind(0))
    captions = [torch.randn(7, 16, generator=g), torch.randn(12, 16, generator=g)]
    return torch.stack(transformer(latents, torch.tensor([0.3, 0.8]), captions, return_dict=False)[0])


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_exported_lora_loads_in_diffusers_and_computes_the_trained_model(trained, folders, fmt, one_thread):
    """diffusers' own ZImagePipeline.load_lora_weights reads the file the run exported, drops none of its layers,
    and its transformer then computes what the trained one does (1e-5, fp32 files)."""
    from diffusers import ZImagePipeline

    from stabletune_core.lora.layers import iter_lora_layers

    run, _ = trained
    ours = trained_bundle(folders["base"], run, 4)
    expected = output(ours.denoiser)
    pipe = ZImagePipeline.from_pretrained(str(folders["base"]), local_files_only=True)
    base = output(pipe.transformer)
    file = run / "output" / ("lora.safetensors" if fmt == "kohya" else "lora_diffusers")
    loaded = pipe.lora_state_dict(str(file))
    adapted = {f"transformer.{layer.path}" for layer in iter_lora_layers(ours.denoiser)}
    assert {re.sub(r"\.lora_[AB]\.weight$", "", k) for k in loaded} == adapted
    pipe.load_lora_weights(str(file))
    got = output(pipe.transformer)
    assert (expected - base).abs().max() > 1e-4  # four steps did move the model
    assert (got - expected).abs().max() <= TOLERANCE


# ComfyUI's rule, written from reading comfy/lora.py `model_lora_keys_unet` (its `comfy.model_base.Lumina2` branch,
# which Z-Image loads as) and comfy/utils.py `z_image_to_diffusers`: for every diffusers weight key k of the model
# that the map names, the LoRA key "diffusion_model." + k minus ".weight" is matched (also "transformer.", "lycoris_"
# and the bare path), targeting the ComfyUI weight, with q/k/v as slices of the fused attention.qkv; comfy/lora.py
# `load_lora` then reads "<key>.lora_up.weight" / "lora_down.weight" / "alpha". Any other key is "not loaded".
def comfy_z_image_key_map(n_layers: int, dim: int, n_refiner_layers: int = 2) -> dict[str, object]:
    """{LoRA key: ComfyUI weight, or (weight, (dim, start, length)) for a slice}."""
    targets: dict[str, object] = {}

    def block(frm: str, to: str, adaln: bool) -> None:
        for i, part in enumerate("qkv"):
            targets[f"{frm}.attention.to_{part}.weight"] = (f"{to}.attention.qkv.weight", (0, i * dim, dim))
        same = ["attention_norm1.weight", "attention_norm2.weight", "feed_forward.w1.weight",
                "feed_forward.w2.weight", "feed_forward.w3.weight", "ffn_norm1.weight", "ffn_norm2.weight"]
        targets.update({f"{frm}.{k}": f"{to}.{k}" for k in same})
        targets[f"{frm}.attention.to_out.0.weight"] = f"{to}.attention.out.weight"
        if adaln:
            targets[f"{frm}.adaLN_modulation.0.weight"] = f"{to}.adaLN_modulation.0.weight"

    for i in range(n_layers):
        block(f"layers.{i}", f"diffusion_model.layers.{i}", True)
    for i in range(n_refiner_layers):
        block(f"context_refiner.{i}", f"diffusion_model.context_refiner.{i}", True)
        block(f"noise_refiner.{i}", f"diffusion_model.noise_refiner.{i}", True)
    basic = {"all_final_layer.2-1.linear.weight": "final_layer.linear.weight",
             "all_final_layer.2-1.adaLN_modulation.1.weight": "final_layer.adaLN_modulation.1.weight",
             "all_x_embedder.2-1.weight": "x_embedder.weight", "cap_embedder.1.weight": "cap_embedder.1.weight",
             "t_embedder.mlp.0.weight": "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight": "t_embedder.mlp.2.weight"}
    targets.update({k: f"diffusion_model.{v}" for k, v in basic.items()})
    key_map = {}
    for k, to in targets.items():
        lora = k[: -len(".weight")]
        for name in (f"diffusion_model.{lora}", f"transformer.{lora}", "lycoris_" + lora.replace(".", "_"), lora):
            key_map[name] = to
    return key_map


def test_every_key_of_the_exported_file_is_one_comfyui_matches(trained, folders):
    run, _ = trained
    tensors = load_file(run / "output" / "lora.safetensors")
    config = load(folders["base"]).denoiser.config
    key_map = comfy_z_image_key_map(config["n_layers"], config["dim"], config["n_refiner_layers"])
    matched = set()
    for lora_key, target in key_map.items():
        if f"{lora_key}.lora_up.weight" in tensors:
            matched |= {f"{lora_key}.{s}" for s in ("lora_up.weight", "lora_down.weight", "alpha")}
            if isinstance(target, tuple):  # a slice of the fused qkv: the LoRA's rows must fill exactly that slice
                assert tensors[f"{lora_key}.lora_up.weight"].shape[0] == target[1][2]
    assert set(tensors) == matched  # every key loaded, none left as "lora key not loaded"


# ---- Turbo, and bad input -----------------------------------------------------------------------------------------
def test_turbo_is_named_as_distilled_in_one_sentence_before_training(folders, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(folders["turbo"], shapes_dataset, run, max_train_steps=1))
    assert done.returncode == 0, done.stderr[-3000:]
    warning = next(e["message"] for e in events_of(run, "model") if "blur" in e["message"])
    assert one_sentence(warning) and "Z-Image-Turbo" in warning and "preview_model" in warning
    assert done.stderr.index(f"model: {warning}") < done.stderr.index("training:")


def test_distillation_is_judged_by_the_released_names():
    from stabletune_core.models.z_image.family import detect_distillation

    assert detect_distillation("/m/Z-Image-Turbo").verdict == "distilled"
    assert detect_distillation("/m/z_image_turbo_bf16.safetensors").verdict == "distilled"
    assert detect_distillation("/m/Z-Image").verdict == "base"
    assert detect_distillation("/m/my-model").verdict == "unknown"


def failed_in_one_sentence(done, run: Path, *words: str) -> str:
    assert done.returncode != 0
    status = RunReader(run).status()
    assert status["state"] == "failed"
    message = status.get("error") or status.get("message") or ""
    assert one_sentence(message) and all(w in message for w in words), message
    assert "Traceback" not in done.stderr
    return message


@pytest.mark.parametrize("family", ["sd1", "flux2_klein"])
def test_a_z_image_folder_forced_to_another_family_is_refused(folders, shapes_dataset, tmp_path, family):
    run = tmp_path / "run"
    done = cli(*small_args(folders["base"], shapes_dataset, run, model_family=family, max_train_steps=1))
    failed_in_one_sentence(done, run, "Z-Image", "model_family", "z_image")


def test_sd_only_options_are_refused_on_z_image(folders, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(folders["base"], shapes_dataset, run, model_family="z_image", snr_gamma=5,
                           max_train_steps=1))
    message = failed_in_one_sentence(done, run, "snr_gamma", "Z-Image")
    assert "Klein" not in message


# ---- stability: NaN rollback, exact resume after SIGKILL ----------------------------------------------------------
STEPS = 6


def fault_config(folder: Path, model: Path, shapes_dataset: Path, **overrides) -> Path:
    from test_faults import write_config

    values = dict(model_family="z_image", resolution=64, max_bucket_reso=128)
    return write_config(folder, model, shapes_dataset, **{**values, **overrides})


@pytest.fixture(scope="module")
def background(tmp_path_factory, folders, shapes_dataset):
    from test_faults import start

    root = tmp_path_factory.mktemp("z-image-faults")
    clean = fault_config(root / "clean", folders["base"], shapes_dataset)
    faulty = fault_config(root / "faulty", folders["base"], shapes_dataset, nan_window=4, nan_max_bad=2)
    processes = {"clean": (start(clean), clean), "faulty": (start(faulty, "nan_loss@2,nan_grad@3"), faulty)}
    yield processes
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()


def test_killed_then_resumed_is_bitwise_the_uninterrupted_run(background, folders, shapes_dataset, tmp_path):
    from test_faults import finish, run as run_cli

    config = fault_config(tmp_path, folders["base"], shapes_dataset)
    run = tmp_path / "run"
    first = run_cli(config, faults="kill@step:3")
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    second = run_cli(config, resume=True)
    assert second.returncode == 0, second.stderr[-3000:]
    clean_process, clean_config = background["clean"]
    finish(clean_process, clean_config)
    clean = clean_config.parent / "run"
    expected, got = RunReader(clean).metrics(), RunReader(run).metrics()
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in expected]
    a, b = load_file(clean / "output" / "lora.safetensors"), load_file(run / "output" / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [Path(e["path"]).name for e in events_of(run, "resumed_from_checkpoint")] == ["step_000002"]


def test_nan_is_rolled_back(background):
    from test_faults import finish

    process, config = background["faulty"]
    finish(process, config)
    run = config.parent / "run"
    assert RunReader(run).status()["state"] == "finished"
    assert [(e["step"], e["what"]) for e in events_of(run, "nonfinite")] == [(2, "loss"), (3, "gradients")]
    assert len(events_of(run, "rollback")) == 1
    weights = load_file(run / "output" / "lora.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
