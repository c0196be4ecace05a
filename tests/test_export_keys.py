"""The kohya names we export name real weights of the original checkpoint, for every family and target set
(issue 15 item 17); unknown targets are refused (item 18); the metadata tells the truth (item 19).

The names are mapped back to the original (CompVis / SGM) layout here the way A1111 and ComfyUI do it, written
out independently of our exporter, and looked up in the single-file checkpoint our own converter writes.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stabletune_core.config import ConfigError, build_config
from stabletune_core.lora.export import kohya_state_dict
from stabletune_core.lora.inject import add_lora
from stabletune_core.models import get_family
from stabletune_core.models.sd import tiny
from stabletune_core.models.base import ModelBundle

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
RESNET_AND_CONV = ATTENTION + ["proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "time_emb_proj",
                               "conv_shortcut", "conv", "conv_in", "conv_out"]
PRESETS = {  # name -> (unet targets, train the text encoders)
    "attention": (ATTENTION, False),
    "resnet_conv": (RESNET_AND_CONV, False),
    "text_encoder": (ATTENTION, True),
}
FAMILIES = {  # family -> (components builder, single-file builder)
    "sd1": (tiny.build_tiny_components, tiny.build_tiny_sd1_single_file),
    "sd2": (tiny.build_tiny_sd2_components, tiny.build_tiny_sd2_single_file),
    "sdxl": (tiny.build_tiny_sdxl_components, tiny.build_tiny_sdxl_single_file),
}
_RESNET_SUFFIX = {"conv1": "in_layers_2", "conv2": "out_layers_3", "norm1": "in_layers_0", "norm2": "out_layers_0",
                  "time_emb_proj": "emb_layers_1", "conv_shortcut": "skip_connection"}
_OPEN_CLIP = [("mlp_fc1", "mlp_c_fc"), ("mlp_fc2", "mlp_c_proj"), ("self_attn_out_proj", "attn_out_proj")]


def bundle_with_lora(family_name: str, targets: list[str], train_text_encoder: bool,
                     network_type: str = "lora") -> ModelBundle:
    parts = FAMILIES[family_name][0](seed=0)
    encoders = [parts["text_encoder"]] + ([parts["text_encoder_2"]] if "text_encoder_2" in parts else [])
    bundle = ModelBundle(family=get_family(family_name), denoiser=parts["unet"], vae=parts["vae"], text_encoders=encoders,
                         tokenizers=[], noise_scheduler=parts["scheduler"], source="tiny")
    dora = network_type == "dora"  # a LoRA with use_dora
    add_lora(bundle, build_config(dict(unet_lora_targets=targets, train_text_encoder=train_text_encoder,
                                       lora_rank=2, lora_alpha=2, network_type="lora" if dora else network_type,
                                       use_dora=dora)))
    return bundle


def compvis_unet_name(name: str, unet_config) -> str:
    """A1111's convert_diffusers_name_to_compvis for SD 1.x/2.x kohya UNet names, for any layers_per_block."""
    n = unet_config["layers_per_block"] + 1
    up_attention = ["CrossAttn" in t for t in unet_config["up_block_types"]]

    def resnet(kind: str, suffix: str) -> str:
        return _RESNET_SUFFIX.get(suffix, suffix) if kind == "resnets" else suffix

    rules = [
        (r"conv_in(.*)", lambda m: f"input_blocks_0_0{m[1]}"),
        (r"conv_out(.*)", lambda m: f"out_2{m[1]}"),
        (r"time_embedding_linear_(\d+)(.*)", lambda m: f"time_embed_{int(m[1]) * 2 - 2}{m[2]}"),
        (r"down_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)", lambda m: f"input_blocks_{1 + int(m[1]) * n + int(m[3])}"
         f"_{1 if m[2] == 'attentions' else 0}_{resnet(m[2], m[4])}"),
        (r"mid_block_(attentions|resnets)_(\d+)_(.+)",
         lambda m: f"middle_block_{1 if m[1] == 'attentions' else int(m[2]) * 2}_{resnet(m[1], m[3])}"),
        (r"up_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)", lambda m: f"output_blocks_{int(m[1]) * n + int(m[3])}"
         f"_{1 if m[2] == 'attentions' else 0}_{resnet(m[2], m[4])}"),
        (r"down_blocks_(\d+)_downsamplers_0_conv", lambda m: f"input_blocks_{n + int(m[1]) * n}_0_op"),
        (r"up_blocks_(\d+)_upsamplers_0_conv",
         lambda m: f"output_blocks_{n - 1 + int(m[1]) * n}_{2 if up_attention[int(m[1])] else 1}_conv"),
    ]
    for pattern, to in rules:
        if m := re.fullmatch(pattern, name):
            return to(m)
    raise AssertionError(f"no A1111 rule maps lora_unet_{name}")


def checkpoint_weight(name: str, family_name: str, unet_config, keys: dict[str, tuple]) -> tuple[str, tuple]:
    """(checkpoint key, expected shape of up @ down) of one exported kohya module name."""
    flat = {k.removesuffix(".weight").replace(".", "_"): k for k in keys}
    if name.startswith("lora_unet_"):
        rest = name.removeprefix("lora_unet_")
        orig = rest if family_name == "sdxl" else compvis_unet_name(rest, unet_config)  # SDXL names are SGM already
        key = flat.get("model_diffusion_model_" + orig)
    else:
        prefix, rest = name.split("_text_model_", 1)
        open_clip = family_name == "sd2" or prefix == "lora_te2"
        if not open_clip:
            root = {"lora_te": "cond_stage_model_transformer", "lora_te1": "conditioner_embedders_0_transformer"}[prefix]
            key = flat.get(f"{root}_text_model_{rest}")
        else:
            root = "cond_stage_model_model" if family_name == "sd2" else "conditioner_embedders_1_model"
            m = re.fullmatch(r"encoder_layers_(\d+)_(.+)", rest)
            layer, part = m[1], m[2]
            if re.fullmatch(r"self_attn_[qkv]_proj", part):  # OpenCLIP keeps q, k, v fused in in_proj
                key = flat.get(f"{root}_transformer_resblocks_{layer}_attn_in_proj_weight")
                assert key, name
                rows, cols = keys[key]
                return key, (rows // 3, cols)
            for ours, theirs in _OPEN_CLIP:
                part = part.replace(ours, theirs)
            key = flat.get(f"{root}_transformer_resblocks_{layer}_{part}")
    assert key, f"{name} names no weight of the {family_name} checkpoint"
    return key, keys[key]


def update_shape(tensors: dict[str, torch.Tensor], name: str) -> tuple[int, int]:
    """(rows, columns) of a module's update as its loader builds it: up @ down (LoRA), the Hadamard product of
    two pairs (LoHa) or the Kronecker product of two factors (LoKr); convs flattened to (out, in x kh x kw)."""
    def part(key: str) -> torch.Tensor | None:
        return tensors.get(f"{name}.{key}")

    if part("lora_up.weight") is not None:
        return part("lora_up.weight").shape[0], part("lora_down.weight")[0].numel()
    if part("hada_w1_a") is not None:
        return part("hada_w1_a").shape[0], part("hada_w1_b").shape[1]
    w1 = part("lokr_w1") if part("lokr_w1") is not None else part("lokr_w1_a") @ part("lokr_w1_b")
    w2 = part("lokr_w2") if part("lokr_w2") is not None else part("lokr_w2_a") @ part("lokr_w2_b")
    return w1.shape[0] * w2.shape[0], w1.shape[1] * w2[0].numel()


CASES = [(family, preset, "lora") for family in FAMILIES for preset in PRESETS] + [
    (family, preset, network) for family in FAMILIES for preset in ("resnet_conv", "text_encoder")
    for network in ("loha", "lokr", "dora")]  # issue 13 items 4 and 5: DoRA and LyCORIS files name the same weights


@pytest.mark.parametrize("family_name, preset, network_type", CASES)
def test_kohya_names_are_checkpoint_weights(family_name, preset, network_type, tmp_path):
    targets, train_te = PRESETS[preset]
    checkpoint = FAMILIES[family_name][1](tmp_path / "model.safetensors", seed=0)
    with safe_open(str(checkpoint), "pt") as f:
        keys = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    bundle = bundle_with_lora(family_name, targets, train_te, network_type)
    tensors = kohya_state_dict(bundle.denoiser, bundle.text_encoders if train_te else None, bundle.family,
                               dtype=torch.float32)
    names = sorted({k.split(".", 1)[0] for k in tensors})
    te_names = [n for n in names if n.startswith("lora_te")]
    assert bool(te_names) == train_te
    if family_name == "sdxl" and train_te:
        assert {n.split("_text_model_")[0] for n in te_names} == {"lora_te1", "lora_te2"}
    used = set()
    for name in names:
        key, shape = checkpoint_weight(name, family_name, bundle.denoiser.config, keys)
        flat = (shape[0], math.prod(shape[1:]))
        assert update_shape(tensors, name) == flat, f"{name} -> {key}: {update_shape(tensors, name)} != {flat}"
        if network_type == "dora":  # one magnitude per input channel of that weight, shaped as the WebUIs divide
            assert tensors[f"{name}.dora_scale"].shape == (1, shape[1], *[1] * (len(shape) - 2)), name
        used.add((key, name[-6:] if "in_proj" in key else ""))  # q, k and v share the fused in_proj
    assert len(used) == len(names)  # no two modules land on the same weight
    if preset == "resnet_conv":  # the ResNet insides were really targeted and mapped (item 17's bug)
        for inner in ("in_layers", "out_layers", "emb_layers", "skip_connection"):
            assert any(inner in k for k, _ in used), inner


# ---- item 18: targets that match nothing are refused, with the closest real names ----------------------------
def test_unknown_target_is_refused_with_closest_names():
    with pytest.raises(ConfigError) as refused:
        bundle_with_lora("sd1", ["to_q", "to_kk", "attn1.to_vv"], False)
    problems = refused.value.problems
    assert len(problems) == 2  # one sentence per bad suffix; to_q is fine
    assert "'to_kk' matches no layer of the UNet" in problems[0] and "to_k" in problems[0].split("closest")[1]
    assert "'attn1.to_vv'" in problems[1] and "attn1.to_v" in problems[1]
    with pytest.raises(ConfigError, match="norm1.*GroupNorm.*cannot adapt"):
        bundle_with_lora("sdxl", ["norm1"], False)  # a real name, but no layer LoRA can train


def test_unknown_target_fails_the_run_in_one_sentence(tiny_model, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "stabletune_core", "train", "--pretrained_model_name_or_path", str(tiny_model),
         "--train_data_dir", str(shapes_dataset), "--output_dir", str(run), "--resolution", "64",
         "--max_train_steps", "2", "--unet_lora_targets", "to_q", "to_kv"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'to_kv' matches no layer of the UNet" in errors[0], result.stderr
    assert not list(run.glob("output/*.safetensors")) and not list(run.glob("checkpoints/step_*"))  # nothing trained
    assert not (run / "metrics.jsonl").exists()


# ---- item 19: the metadata says what was trained, without the trainer's local paths ---------------------------
def test_metadata_has_trained_resolution_real_epoch_and_no_local_paths(tiny_config, tiny_model, shapes_dataset,
                                                                       tmp_path, one_thread):
    from stabletune_core.lora.export import read_lora_metadata
    from stabletune_core.runs.reader import RunReader
    from stabletune_core.train.loop import train

    config = tiny_config(max_train_steps=5, logging_steps=1)
    meta = read_lora_metadata(train(config))
    assert meta["modelspec.resolution"] == f"{config.resolution}x{config.resolution}"
    assert meta["ss_resolution"] == f"({config.resolution}, {config.resolution})"
    last_epoch = RunReader(config.output_dir).metrics()[-1]["epoch"]  # 0-based in the run's own metrics
    assert last_epoch >= 1 and meta["ss_epoch"] == str(last_epoch + 1)
    for folder in (tmp_path, shapes_dataset, tiny_model):
        leaked = [k for k, v in meta.items() if str(folder) in v]
        assert not leaked, f"{folder} leaks into {leaked}"
    stored = json.loads(meta["stabletune_config"])
    assert stored["train_data_dir"] == shapes_dataset.name
    assert stored["pretrained_model_name_or_path"] == tiny_model.name
    assert stored["output_dir"] == "."
    assert stored["learning_rate"] == config.learning_rate  # the rest of the config is all there


def test_shareable_config_strips_every_path_knob_the_schema_marks(tmp_path):
    """Issue 22.4: the schema marks the path knobs; none of them reaches a shared LoRA with the trainer's absolute
    path (reg_data_dir leaked before: every LoRA trained with class images carried the reg folder's path)."""
    from stabletune_core.config import PATH_KNOBS, TrainConfig
    from stabletune_core.train.lora_output import shareable_config

    assert {"pretrained_model_name_or_path", "train_data_dir", "reg_data_dir", "model_config_dir", "output_dir",
            "resume_from_checkpoint"} <= set(PATH_KNOBS)
    folders = {name: tmp_path / "machine" / f"my-{name}" for name in PATH_KNOBS}
    for folder in folders.values():
        folder.mkdir(parents=True)
    config = TrainConfig.model_construct(**{**TrainConfig().model_dump(), **{k: str(v) for k, v in folders.items()}})
    stored = shareable_config(config)
    assert str(tmp_path) not in json.dumps(stored)
    assert stored["reg_data_dir"] == "my-reg_data_dir" and stored["output_dir"] == "."
    assert shareable_config(TrainConfig(pretrained_model_name_or_path="owner/model"))[
        "pretrained_model_name_or_path"] == "owner/model"  # a hub id is no path of this machine


# ---- item 20: the pinned transformers works with the pinned peft, as a user loads and switches LoRAs ----------
def test_text_encoder_lora_loads_and_switches_in_diffusers(tiny_model, tmp_path):
    """What a user does with our file: load it into a pipeline, then use the text encoder's adapter API (diffusers'
    set_adapters and transformers' set_adapter / active_adapters). transformers 5.24+ refuses peft 0.21 there
    ("please use a version >= 0.22.0"); the pinned 5.23 must not."""
    from diffusers import StableDiffusionPipeline

    from stabletune_core.lora.export import export_kohya_lora

    family = get_family("sd1")
    bundle = family.load(str(tiny_model))
    add_lora(bundle, build_config(dict(train_text_encoder=True, lora_rank=2, lora_alpha=2)))
    with torch.no_grad():
        for name, p in bundle.text_encoders[0].named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    path = export_kohya_lora(tmp_path / "te.safetensors", bundle.denoiser, bundle.text_encoders, family, rank=2, alpha=2)

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), local_files_only=True, safety_checker=None)
    ids = pipe.tokenizer(["a red square"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    base = pipe.text_encoder(ids)[0]
    pipe.load_lora_weights(str(path), adapter_name="mine")
    pipe.set_adapters(["mine"], [0.5])
    pipe.text_encoder.set_adapter("mine")
    assert pipe.text_encoder.active_adapters() == ["mine"]
    assert not torch.allclose(pipe.text_encoder(ids)[0], base, atol=1e-5)  # the text-encoder LoRA is applied
