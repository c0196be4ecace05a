"""Issue 37.2: how each host loads pivotal tuning's words, made true and said exactly.

Forge's rules, re-stated from its code (extensions-builtin/sd_forge_lora/networks.py, load_lora_for_models, and
backend/text_processing/textual_inversion.py): the keys of a LoRA file that match no layer of the model are counted,
and more than 12 refuse the whole file ("LoRA version mismatch"); `bundle_emb.*` keys match no layer and are never
read as words (its loaded_bundle_embeddings stays empty); words come from the embeddings folder, named after their
file, read by create_embedding_from_data (SDXL: clip_l and clip_g). diffusers' SDXL pipeline takes one text
encoder's vectors per load_textual_inversion call.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_failures import base_flags, train
from test_pivotal import COMMON, token_dataset, webui_vectors  # noqa: F401 (token_dataset is a fixture)

README = Path(__file__).resolve().parent.parent / "README.md"
WORDS = ["<p1>=red", "<p2>=dog", "<p3>=blue", "<p4>=cat", "<p5>=green", "<p6>=car", "<p7>=tree"]


def forge_refuses(lora: dict[str, torch.Tensor]) -> bool:
    """Forge's count: every key of our LoRA modules matches a layer; the bundle_emb.* keys match none."""
    return sum(key.startswith("bundle_emb.") for key in lora) > 12


@pytest.fixture(scope="module")
def sdxl_run(tmp_path_factory, shapes_dataset):
    import shutil

    from stabletune_core.models.sd.tiny import build_tiny_sdxl

    root = tmp_path_factory.mktemp("pivotal-hosts")
    data = root / "data"
    shutil.copytree(shapes_dataset, data)
    for caption in data.glob("*.txt"):
        caption.write_text(caption.read_text().replace("red", "<p1>"))
    model = build_tiny_sdxl(root / "xl", seed=0)
    run = root / "run"
    result = train(base_flags(model, data, run) + ["--max_train_steps", "1", "--pivotal_tokens", *WORDS])
    assert result.returncode == 0, result.stderr[-3000:]
    return model, run, result.stdout


def test_seven_sdxl_words_get_a_lora_forge_loads_and_the_words_load_from_its_embeddings_folder(sdxl_run):
    _, run, stdout = sdxl_run
    lora = load_file(run / "output" / "lora.safetensors")
    assert sum(k.startswith("bundle_emb.") for k in lora) == 14 and forge_refuses(lora)  # A1111's file
    forge = load_file(run / "output" / "lora_forge.safetensors")
    assert not forge_refuses(forge) and not [k for k in forge if k.startswith("bundle_emb.")]
    assert forge.keys() == {k for k in lora if not k.startswith("bundle_emb.")}
    assert all(torch.equal(forge[k], lora[k]) for k in forge)
    for spec in WORDS:  # Forge's embeddings folder: the file's name is the word, clip_l and clip_g its vectors
        token = spec.split("=")[0]
        data = load_file(run / "output" / "lora_embeddings" / f"{token.strip('<>')}.safetensors")
        vectors = webui_vectors(data)
        assert torch.equal(vectors["clip_l"], lora[f"bundle_emb.{token}.clip_l"])
        assert torch.equal(vectors["clip_g"], lora[f"bundle_emb.{token}.clip_g"])
    words = [line for line in stdout.splitlines() if line.startswith("words: ")]
    forge_line = next(line for line in words if line.startswith("words: Forge:"))
    assert "lora_forge.safetensors" in forge_line and "embeddings folder" in forge_line and "p7" in forge_line
    assert any("text_encoder_2" in line and "clip_g" in line for line in words), words
    assert stdout.strip().splitlines()[-1].startswith("words: ")  # the run's last lines


def test_diffusers_loads_an_sdxl_word_one_text_encoder_per_call_as_the_readme_says(sdxl_run):
    from diffusers import StableDiffusionXLPipeline

    model, run, _ = sdxl_run
    file = run / "output" / "lora_embeddings" / "p1.safetensors"
    pipe = StableDiffusionXLPipeline.from_pretrained(str(model))
    with pytest.raises(ValueError, match="Loaded state dictionary is incorrect"):
        pipe.load_textual_inversion(str(file), token="<p1>")  # what the README said before
    state = load_file(file)
    pipe.load_textual_inversion(state["clip_l"], token="<p1>", text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(state["clip_g"], token="<p1>", text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    for encoder, tokenizer, key in ((pipe.text_encoder, pipe.tokenizer, "clip_l"),
                                    (pipe.text_encoder_2, pipe.tokenizer_2, "clip_g")):
        ids = tokenizer.convert_tokens_to_ids(["<p1>"])
        assert torch.equal(encoder.get_input_embeddings().weight[ids].detach(), state[key][:1].float())
    readme = README.read_text()
    assert "text_encoder=pipe.text_encoder_2" in readme and "_forge.safetensors" in readme
    assert "more than 12" in readme


def test_forge_limit_counts_word_tensors():
    from stabletune_core.lora.pivotal import bundle_tensors, forge_refuses_bundle

    one_encoder = type("Family", (), {"tokenizer_parts": ("tokenizer",)})()
    vectors = {f"<w{i}>": [torch.zeros(1, 8)] for i in range(13)}
    assert not forge_refuses_bundle(bundle_tensors(dict(list(vectors.items())[:12]), one_encoder, torch.float32))
    assert forge_refuses_bundle(bundle_tensors(vectors, one_encoder, torch.float32))
