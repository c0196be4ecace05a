"""#13.4 DoRA (use_dora): trained with peft's DoRA layers in the WebUIs' per-input-channel form, exported with the
`dora_scale` key A1111, Forge and ComfyUI read. The proof: the file, applied to a fresh base model by the WebUIs'
merge rule (written out here, independently of our code), reproduces the trained model's outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import ConfigError, build_config
from stabletune_core.lora.export import read_lora_metadata

from webui_merge import trained_and_merged_outputs

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "conv2"]  # attention, linear-ish and 3x3 conv


def webui_weight(weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A1111's network_lora + network.py apply_weight_decompose (ComfyUI's weight_decompose for a dora_scale whose
    first dimension is 1): W' = dora_scale * (W + dW) / ||W + dW||, the norm taken over every axis but the input
    channel one."""
    down, up = parts["lora_down.weight"].double(), parts["lora_up.weight"].double()
    scale = parts["alpha"].item() / down.shape[0]
    merged = weight.double() + (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * scale
    if "dora_scale" in parts:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(merged.shape[1], *[1] * (merged.dim() - 1)).transpose(0, 1)
        merged = merged * (parts["dora_scale"].double() / norm)
    return merged


def test_a_dora_layer_computes_the_webui_merged_weight_for_linear_and_conv():
    from peft import LoraConfig, inject_adapter_in_model

    from stabletune_core.lora.dora import dora_scale, use_input_axis_dora
    from stabletune_core.lora.layers import iter_lora_layers

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(6, 5), "conv": torch.nn.Conv2d(3, 4, 3, padding=1)})
    base = {name: (m.weight.detach().clone(), m.bias.detach().clone()) for name, m in model.items()}
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=6, target_modules=["lin", "conv"], use_dora=True), model)
    assert use_input_axis_dora(model) == 2
    layers = {layer.path: layer for layer in iter_lora_layers(model)}
    assert all(layer.dora_on_input for layer in layers.values())
    assert dora_scale(layers["lin"]).shape == (1, 6) and dora_scale(layers["conv"]).shape == (1, 3, 1, 1)
    # At the start (up = 0) the layer is the base layer: the magnitudes are the base weight's column norms.
    x, image = torch.randn(2, 6), torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(model["lin"](x), torch.nn.functional.linear(x, *base["lin"]))
        for layer in layers.values():
            layer.down.normal_()
            layer.up.normal_()
            layer.magnitude.mul_(torch.rand_like(layer.magnitude) + 0.5)
        model.eval()
        for name, inputs in (("lin", x), ("conv", image)):
            layer = layers[name]
            parts = {"lora_down.weight": layer.down, "lora_up.weight": layer.up,
                     "alpha": torch.tensor(layer.kohya_alpha), "dora_scale": dora_scale(layer)}
            weight, bias = webui_weight(base[name][0], parts).float(), base[name][1]
            expected = (torch.nn.functional.linear(inputs, weight, bias) if name == "lin"
                        else torch.nn.functional.conv2d(inputs, weight, bias, padding=1))
            torch.testing.assert_close(model[name](inputs), expected, atol=1e-5, rtol=1e-5)


def test_exported_dora_file_reproduces_the_trained_model_by_the_webui_rule(tiny_config, tiny_model, one_thread):
    from stabletune_core.lora.layers import run_lora_layers
    from stabletune_core.train.loop import setup, train

    config = tiny_config(use_dora=True, unet_lora_targets=TARGETS, train_text_encoder=True, lora_rank=4,
                         lora_alpha=2, learning_rate=1e-2, max_train_steps=6, diagnostics_every=2,
                         activation_stats_every=2, lora_dropout=0.1)
    session = setup(config)
    at_start = {name: layer.magnitude.detach().clone()
                for name, layer in run_lora_layers(session.trained, session.ranks.unwrap)}
    lora = train(config, session=session)
    walked = dict(run_lora_layers(session.trained, session.ranks.unwrap))
    assert all(layer.dora_on_input for layer in walked.values())
    assert any(not torch.equal(walked[name].magnitude, at_start[name]) for name in walked)  # the magnitudes learned

    tensors = load_file(lora)
    scales = {k: v for k, v in tensors.items() if k.endswith(".dora_scale")}
    assert len(scales) == len(walked) and all(v.dim() in (2, 4) and v.shape[0] == 1 for v in scales.values())
    assert any("resnets_0_conv1" in k for k in scales)  # conv layers are DoRA too
    meta = read_lora_metadata(lora)
    assert json.loads(meta["ss_network_args"]) == {"algo": "lora", "dora_wd": "True"}
    spectra = Path(config.output_dir) / "diagnostics" / "spectra.jsonl"
    assert spectra.is_file()  # the rank spectra ran on the DoRA run's direction (up @ down)

    out, unet_with = trained_and_merged_outputs(session, tensors, str(tiny_model), webui_weight)
    torch.testing.assert_close(out.te_merged, out.te_trained, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.unet_merged, out.unet_trained, atol=1e-4, rtol=1e-4)
    assert (out.unet_merged - out.unet_base).abs().max() > 1e-3  # the UNet update is really there
    out_plain = unet_with({k: v for k, v in tensors.items() if not k.endswith(".dora_scale")})
    assert (out.unet_merged - out_plain).abs().max() > 1e-4  # and the magnitudes are part of it


def test_dora_run_resumes_exactly(tiny_config, one_thread, tmp_path):
    from stabletune_core.train.loop import train

    common = dict(use_dora=True, unet_lora_targets=["to_q", "to_v", "conv1"], lora_rank=4, max_train_steps=4,
                  save_steps=2, learning_rate=1e-2, diagnostics_every=0, activation_stats_every=0,
                  validation_loss_every=0)
    train(tiny_config(output_dir=str(tmp_path / "straight"), **common))
    train(tiny_config(output_dir=str(tmp_path / "resumed"), **common,
                      resume_from_checkpoint=str(tmp_path / "straight" / "checkpoints" / "step_000002")))
    a, b = (load_file(tmp_path / run / "output" / "lora.safetensors") for run in ("straight", "resumed"))
    assert any(k.endswith(".dora_scale") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_dora_cannot_do_is_one_sentence(tmp_path, capsys):
    from safetensors.torch import save_file

    from stabletune_core import cli

    with pytest.raises(ConfigError, match="use_dora decomposes a LoRA's weight"):
        build_config(dict(network_type="loha", use_dora=True))
    with pytest.raises(ConfigError, match="diffusers applies DoRA per output channel"):
        build_config(dict(use_dora=True, export_diffusers_format=True))
    assert any("LoRA direction (up@down) only" in n for n in build_config(dict(use_dora=True)).notes())
    assert not build_config(dict(use_dora=True, diagnostics_every=0, activation_stats_every=0)).notes()

    path = tmp_path / "dora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.ones(2, 4), "lora_unet_x.lora_up.weight": torch.ones(4, 2),
               "lora_unet_x.alpha": torch.tensor(2.0), "lora_unet_x.dora_scale": torch.ones(1, 4)}, str(path))
    assert cli.main(["resize", str(path), "--rank", "1"]) != 0
    assert "not a plain LoRA" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["dora.safetensors"]  # no NAME-r1.safetensors beside it
