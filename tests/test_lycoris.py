"""#13.5 LoHa and LoKr (network_type): trained by peft, exported as LyCORIS files that A1111, Forge and ComfyUI
load. The proof: the file, applied to a fresh base model by the loaders' merge rule (written out here,
independently of our exporter), reproduces the trained model's UNet and text-encoder outputs."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import ConfigError, build_config
from stabletune_core.lora.export import read_lora_metadata

from webui_merge import trained_and_merged_outputs

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "conv2"]  # attention, linear-ish and 3x3 conv


def lycoris_delta(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A1111's network_hada / network_lokr (and ComfyUI's weight adapters): the update of one weight."""
    parts = {k: v.double() for k, v in parts.items()}
    if "hada_w1_a" in parts:
        update = (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
        dim = parts["hada_w1_b"].shape[0]
    else:
        w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
        w2 = parts["lokr_w2"] if "lokr_w2" in parts else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        update = torch.kron(w1, w2)
        dim = (parts["lokr_w2_b"].shape[0] if "lokr_w2_b" in parts
               else parts["lokr_w1_b"].shape[0] if "lokr_w1_b" in parts else None)
    scale = parts["alpha"].item() / dim if dim is not None and "alpha" in parts else 1.0
    return (update * scale).reshape(shape)


def loader_weight(weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return weight + lycoris_delta(parts, weight.shape).to(weight.dtype)


@pytest.mark.parametrize("network_type", ["loha", "lokr"])
def test_exported_file_reproduces_the_trained_model_by_the_loaders_rule(network_type, tiny_config, tiny_model,
                                                                        one_thread):
    from stabletune_core.train.loop import setup, train

    config = tiny_config(network_type=network_type, unet_lora_targets=TARGETS, train_text_encoder=True,
                         lora_rank=4, lora_alpha=2, learning_rate=1e-2, max_train_steps=6,
                         diagnostics_every=2, activation_stats_every=2, lora_dropout=0.1)
    session = setup(config)
    lora = train(config, session=session)
    tensors = load_file(lora)
    marker = {"loha": ".hada_w1_a", "lokr": ".lokr_w1"}[network_type]
    assert any(marker in k for k in tensors) and not any("lora_down" in k for k in tensors)
    assert any("resnets_0_conv1" in k for k in tensors)  # conv layers are there too
    meta = read_lora_metadata(lora)
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"])["algo"] == network_type

    out, _ = trained_and_merged_outputs(session, tensors, str(tiny_model), loader_weight)
    assert not torch.allclose(out.te_merged, out.te_base)
    torch.testing.assert_close(out.te_merged, out.te_trained, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.unet_merged, out.unet_trained, atol=1e-4, rtol=1e-4)
    assert (out.unet_merged - out.unet_base).abs().max() > 1e-3  # the UNet update is really there


def test_lycoris_run_resumes_exactly(tiny_config, one_thread, tmp_path):
    from stabletune_core.train.loop import train

    common = dict(network_type="loha", unet_lora_targets=TARGETS, lora_rank=4, max_train_steps=6, save_steps=3,
                  lora_dropout=0.1, diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)
    train(tiny_config(output_dir=str(tmp_path / "straight"), **common))
    train(tiny_config(output_dir=str(tmp_path / "resumed"), **common,
                      resume_from_checkpoint=str(tmp_path / "straight" / "checkpoints" / "step_000003")))
    a, b = (load_file(tmp_path / run / "output" / "lora.safetensors") for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_lycoris_cannot_do_is_one_sentence():
    with pytest.raises(ConfigError, match="diffusers cannot load loha files"):
        build_config(dict(network_type="loha", export_diffusers_format=True))
    with pytest.raises(ConfigError, match="scale_weight_norms measures LoRA's up@down"):
        build_config(dict(network_type="lokr", scale_weight_norms=1.0))
    notes = build_config(dict(network_type="lokr")).notes()
    assert any("skips them" in n for n in notes)
    assert not build_config(dict(network_type="lora")).notes()


def test_resize_refuses_a_lycoris_file_in_one_sentence(tmp_path, capsys):
    from stabletune_core import cli
    from safetensors.torch import save_file

    path = tmp_path / "loha.safetensors"
    save_file({"lora_unet_x.hada_w1_a": torch.ones(4, 2), "lora_unet_x.hada_w1_b": torch.ones(2, 4),
               "lora_unet_x.hada_w2_a": torch.ones(4, 2), "lora_unet_x.hada_w2_b": torch.ones(2, 4),
               "lora_unet_x.alpha": torch.tensor(2.0)}, str(path))
    assert cli.main(["resize", str(path), "--rank", "1"]) != 0
    assert "not a plain LoRA" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["loha.safetensors"]  # no NAME-r1.safetensors beside it
