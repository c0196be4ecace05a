"""Issue 36 item 1: base_storage stores the frozen denoiser's Linear weights quantised (int8, nf4; fp8 on a GPU with
native fp8), the LoRA trains on top in fp32 and its file is the same kind of file, with the storage in its metadata.
What the CPU can run is tested here; fp8 on a CPU is refused in one sentence before any model loads."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flux2_tools import one_sentence, tiny_klein_paths
from stabletune_core.config import build_config
from stabletune_core.models.base import ModelLoadError
from stabletune_core.models.quantize import QuantisedLinear, dequantise, quantise, stored_bytes
from stabletune_core.runs.reader import RunReader

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


def klein_run(paths, data: Path, out: Path, **overrides):
    from stabletune_core.train.loop import setup, train

    values = dict(model_family="flux2_klein", pretrained_model_name_or_path=str(paths["folder"]),
                  train_data_dir=str(data), output_dir=str(out), resolution=64, bucket_step=8, min_bucket_reso=32,
                  max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3, max_train_steps=3, lora_rank=4,
                  save_steps=1000, seed=3, save_precision="fp32", validation_split=0)
    config = build_config({**values, **overrides})
    session = setup(config)
    train(config, session=session)
    return session, RunReader(out).metrics()


def lora_file(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = run / "output" / "lora.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    return load_file(path), metadata


@pytest.mark.parametrize("storage, bits", [("int8", 8), ("nf4", 4), ("fp8", 8)])
def test_a_quantised_weight_is_close_to_the_weight_and_smaller(storage, bits):
    torch.manual_seed(0)
    weight = torch.randn(48, 100)
    codes, scale = quantise(weight, storage)
    back = dequantise(codes, scale, storage, (48, 100), torch.float32)
    error = ((back - weight).norm() / weight.norm()).item()
    assert error < {"int8": 0.01, "nf4": 0.12, "fp8": 0.05}[storage]
    assert codes.numel() * codes.element_size() == weight.numel() * bits // 8 + (
        (-weight.numel()) % 64 * bits // 8 if storage == "nf4" else 0)


def test_backward_keeps_the_codes_not_a_full_size_weight():
    """Without gradient checkpointing autograd keeps what each layer saved until the backward pass: a quantised layer
    saves its codes and scales, never the dequantised fp32 weight."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).requires_grad_(False)
    layer = QuantisedLinear(linear, "int8")
    saved: list[torch.Tensor] = []
    x = torch.randn(3, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert not any(t.dtype == torch.float32 and t.shape == (32, 64) for t in saved)
    y.sum().backward()
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(3, -1), rtol=0, atol=0.02)


@pytest.mark.parametrize("storage", ["int8", "nf4"])
def test_klein_trains_on_a_quantised_base_and_the_lora_file_is_the_same_kind(paths, shapes_dataset, tmp_path,
                                                                            one_thread, storage):
    _, full = klein_run(paths, shapes_dataset, tmp_path / "full")
    session, quantised = klein_run(paths, shapes_dataset, tmp_path / storage, base_storage=storage)
    layers = [m for m in session.bundle.denoiser.modules() if isinstance(m, QuantisedLinear)]
    assert layers and all(m.storage == storage for m in layers)
    assert all(p.dtype == torch.float32 for p in session.params)  # the LoRA trains in fp32
    # the same step draws the same batch and noise: the loss moves by what the weights' rounding moves, no more
    first_full, first_quantised = full[0]["loss"], quantised[0]["loss"]
    assert first_quantised != first_full and abs(first_quantised - first_full) < 0.05 * first_full
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in quantised)
    tensors_full, _ = lora_file(tmp_path / "full")
    tensors, metadata = lora_file(tmp_path / storage)
    assert {k: (v.shape, v.dtype) for k, v in tensors.items()} == {k: (v.shape, v.dtype) for k, v in
                                                                      tensors_full.items()}
    assert metadata["stabletune_base_storage"] == storage
    assert json.loads(metadata["stabletune_config"])["base_storage"] == storage
    placement = [e for e in RunReader(tmp_path / storage).events() if e.get("kind") == "placement"]
    assert placement and placement[0]["base_storage"] == storage


def test_a_quantised_base_with_block_swap_is_bitwise_the_quantised_base_alone(paths, shapes_dataset, tmp_path,
                                                                               one_thread):
    """The swapped blocks keep their codes and fp32 scales as stored (not cast to the run's dtype)."""
    _, alone = klein_run(paths, shapes_dataset, tmp_path / "alone", base_storage="nf4", gradient_checkpointing=True,
                         mixed_precision="bf16")
    session, swapped = klein_run(paths, shapes_dataset, tmp_path / "swap", base_storage="nf4",
                                 gradient_checkpointing=True, mixed_precision="bf16", blocks_to_swap=2)
    assert [(m["loss"], m["grad_norm"]) for m in swapped] == [(m["loss"], m["grad_norm"]) for m in alone]
    swap = session.bundle.extra["block_swap"]
    homes = {f.name: f.home.dtype for b in swap.blocks for f in b.frozen}
    assert homes["codes"] == torch.uint8 and homes["scale"] == torch.float32
    a, _ = lora_file(tmp_path / "alone")
    b, _ = lora_file(tmp_path / "swap")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sd_unet_trains_on_an_int8_base(tiny_model, small_config, tmp_path, one_thread):
    from stabletune_core.train.loop import setup, train

    config = small_config(tiny_model, tmp_path / "run", base_storage="int8", max_train_steps=2)
    session = setup(config)
    train(config, session=session)
    assert any(isinstance(m, QuantisedLinear) for m in session.bundle.denoiser.modules())
    assert stored_bytes(session.bundle.denoiser) > 0
    assert RunReader(tmp_path / "run").status()["state"] == "finished"


def test_fp8_on_a_cpu_is_refused_in_one_sentence_before_the_model_loads(paths, shapes_dataset, tmp_path):
    from test_faults import environment

    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "stabletune_core", "train", "--model", str(paths["folder"]),
                             "--dataset", str(shapes_dataset), "--output_dir", str(run), "--resolution", "64",
                             "--max_train_steps", "1", "--base_storage", "fp8"],
                            cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    status = RunReader(run).status()
    assert status["state"] == "failed"
    assert "fp8" in status["error"] and "int8 or nf4" in status["error"] and one_sentence(status["error"])
    assert "Traceback" not in result.stderr and "Loaded" not in result.stderr  # no model was loaded


def test_an_already_quantised_klein_file_is_refused_in_one_sentence(paths, tmp_path):
    from stabletune_core.models.flux2_klein.family import Flux2Klein

    comfy = tmp_path / "ComfyUI"
    shutil.copytree(paths["comfy"], comfy)
    transformer = comfy / Path(paths["transformer"]).relative_to(paths["comfy"])
    state = load_file(transformer)
    first = next(k for k in state if k.endswith(".weight") and state[k].dim() == 2)
    state[first.replace(".weight", ".weight_scale")] = torch.ones(())
    save_file(state, transformer)
    with pytest.raises(ModelLoadError) as caught:
        Flux2Klein().load(transformer)
    assert "already quantised" in str(caught.value) and one_sentence(str(caught.value))


def test_the_text_encoder_is_stored_like_the_base_cached_or_not(paths, shapes_dataset, tmp_path, one_thread):
    """Qwen3 not cached: it is frozen weight on the device every step, stored like the transformer (its output head,
    tied to the token embeddings and unused for hidden states, stays); cached, it is on the device while the caches
    are built, the set-up's peak (Klein 9B's Qwen3-8B: 15.3 GiB in bf16), so it is stored the same way."""
    for name, cached in (("uncached", False), ("cached", True)):
        session, _ = klein_run(paths, shapes_dataset, tmp_path / name, base_storage="int8", max_train_steps=1,
                               cache_text_embeddings=cached)
        encoder = session.bundle.text_encoders[0]
        quantised = [n for n, m in encoder.named_modules() if isinstance(m, QuantisedLinear)]
        assert quantised and all(not n.endswith("lm_head") for n in quantised)
        assert type(encoder.lm_head) is torch.nn.Linear
        event = [e for e in RunReader(tmp_path / name).events() if e.get("kind") == "placement"][0]
        assert event["text_encoders_quantised"] and "transformer and text encoder" in event["message"]


def test_a_resume_never_changes_the_bases_storage_silently(tmp_path):
    """The checkpoint records the storage the adapter was fitted to; a resume asking for another is one sentence
    (an older checkpoint, which recorded none, was trained on the full base and is not refused)."""
    from stabletune_core.lora.inject import adapter_mismatch, adapter_settings

    values = dict(pretrained_model_name_or_path="m", train_data_dir="d", output_dir=str(tmp_path))
    full, int8 = build_config(values), build_config({**values, "base_storage": "int8"})
    sentence = adapter_mismatch(adapter_settings(full), int8, "step_000004")
    assert sentence and "base_storage full" in sentence and "base_storage int8" in sentence and "\n" not in sentence
    assert adapter_mismatch(adapter_settings(int8), int8, "step_000004") is None
    older = {k: v for k, v in adapter_settings(full).items() if k != "base_storage"}
    assert adapter_mismatch(older, full, "step_000004") is None


@pytest.mark.parametrize("storage", ["int8", "nf4"])
def test_dequantising_a_layer_holds_its_output_and_one_chunks_scratch(storage, monkeypatch):
    """A quantised layer dequantises in chunks: beside its codes and its output in the run's dtype it holds one
    chunk's scratch (quantize.SCRATCH_BYTES a weight), which the memory model prices (memory.dequantised_bytes).
    In one pass nf4 held ~25 bytes a weight (int64 indices, fp32 values): 3.7 GiB for Klein 9B's largest layer.
    The values are bitwise those of one pass."""
    import torch

    from bench_scripts import load_bench
    from stabletune_core.models import quantize
    from stabletune_core.models.memory import dequantised_bytes

    weight = torch.randn(1024, 1024)
    codes, scale = quantize.quantise(weight, storage)
    whole = quantize.dequantise(codes, scale, storage, (1024, 1024), torch.bfloat16)
    monkeypatch.setattr(quantize, "DEQUANTISE_CHUNK", 1 << 16)
    counter = load_bench("cpu_peak").LiveTensorBytes()
    with counter:
        chunked = quantize.dequantise(codes, scale, storage, (1024, 1024), torch.bfloat16)
    assert torch.equal(chunked, whole)
    held = counter.peak - codes.untyped_storage().nbytes() - scale.untyped_storage().nbytes()
    output = 1024 * 1024 * 2
    scratch = (1 << 16) * quantize.SCRATCH_BYTES[storage]
    assert output < held <= output + scratch + 4096, (held, output, scratch)
    assert dequantised_bytes(storage, 1024 * 1024, 2) == 2 * output + scratch
