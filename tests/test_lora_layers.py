"""Issue 14.4: one walk over the LoRA layers; export, spectra, the weight-norm guard and the activation statistics
see the same layers (UNet and text encoder, Linear and Conv2d)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from stabletune_core.lora.layers import iter_lora_layers, run_lora_layers

pytestmark = pytest.mark.usefixtures("one_thread")

CORE = Path(__file__).resolve().parent.parent / "stabletune_core"


def test_the_walker_reports_linear_and_conv_layers_with_their_numbers():
    torch.manual_seed(0)
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(6, 5), "conv": torch.nn.Conv2d(3, 4, 3), "skip": torch.nn.Linear(2, 2)})
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=6, lora_dropout=0.25, target_modules=["lin", "conv"]), model)
    layers = {layer.path: layer for layer in iter_lora_layers(model)}
    assert set(layers) == {"lin", "conv"}
    conv = layers["conv"]
    assert conv.down.shape == (2, 3, 3, 3) and conv.up.shape == (4, 2, 1, 1) and conv.rank == 2
    assert conv.scaling == 3.0 and conv.kohya_alpha == 6.0 and conv.dropout == 0.25 and conv.magnitude is None
    assert conv.down is model["conv"].lora_A["default"].weight  # live parameters, not copies
    assert conv.module is model["conv"] and conv.up_module is model["conv"].lora_B["default"]


def test_export_spectra_weight_norms_and_activation_stats_see_the_same_layers(tiny_config):
    from stabletune_core.lora.export import kohya_state_dict
    from stabletune_core.train.observers.diagnostics import ActivationMonitor, all_spectra
    from stabletune_core.train.guards.weightnorm import WeightNormGuard
    from stabletune_core.train.loop import setup
    from stabletune_core.train.session import SessionView

    config = tiny_config(train_text_encoder=True, unet_lora_targets=["to_q", "to_k", "to_v", "to_out.0", "conv1",
                                                                     "conv2"],
                         activation_stats_every=1, diagnostics_every=0, validation_loss_every=0)
    s = setup(config)
    walked = dict(run_lora_layers(s.trained, s.ranks.unwrap))
    assert any(name.startswith("unet.") for name in walked) and any(name.startswith("te0.") for name in walked)
    assert any(layer.down.dim() == 4 for layer in walked.values())  # conv LoRA layers are walked too

    # Spectra
    assert {sp.module for sp in all_spectra(SessionView(s).adapters)} == set(walked)
    # The weight-norm guard sees exactly the walked layers (by index into the view's layers, never the tensors)
    guard = WeightNormGuard(max_norm=1.0)
    guard.on_start(SessionView(s))
    held = {id(t) for indices, _ in guard.groups for i in indices for t in (s.lora_layers[i].down,
                                                                            s.lora_layers[i].up)}
    assert held == {id(t) for layer in walked.values() for t in (layer.down, layer.up)}
    # Export: one lora_down per walked layer, holding that layer's numbers
    tensors = kohya_state_dict(s.trained["unet"], [s.trained["te0"]], s.bundle.family, dtype=torch.float32)
    downs = [t for key, t in tensors.items() if key.endswith(".lora_down.weight")]
    assert len(downs) == len(walked)
    assert sorted(float(t.sum()) for t in downs) == pytest.approx(sorted(float(layer.down.detach().sum())
                                                                         for layer in walked.values()))
    # Activation statistics: the probe encodes its prompt and runs the UNet, so it reaches every layer
    monitor = ActivationMonitor(config, s.evaluator)
    assert {r["module"] for r in monitor.measure(SessionView(s))} == set(walked)


def test_only_the_walker_reads_peft_lora_internals():
    """lora_A / lora_B / scaling are read in one place, so a peft change or a new adapter kind is one edit."""
    readers = set()
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("lora_A", "lora_B"):
                readers.add(str(path.relative_to(CORE)))
    assert readers == {"lora/layers.py"}
