"""Pivotal tuning (issue 26.5): new tokens whose embeddings train with the LoRA.

The knobs and their refusals (one sentence, before the model loads), the rows that train (only the new ones; the
vocabulary's table stays bitwise as it was, and freezes after embedding_train_fraction), the files (bundle_emb.*
inside the LoRA as A1111 reads it, and an embedding file per token, for SD1 and SDXL), an exact resume, and on the
toy base that the token learns the concept, in degrees of hue.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import ConfigError, build_config

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parent.parent
COMMON = dict(diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)


@pytest.fixture
def token_dataset(shapes_dataset, tmp_path) -> Path:
    """The shapes, with the red ones captioned by the new token: "a <p1> circle"."""
    target = tmp_path / "data"
    shutil.copytree(shapes_dataset, target)
    for caption in target.glob("*.txt"):
        caption.write_text(caption.read_text().replace("red", "<p1>"))
    return target


# ---- knobs and refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, sentence", [
    ("<p1>", "is not TOKEN=INIT_WORD"),
    ("<p1>=", "is not TOKEN=INIT_WORD"),
    ("<P1>=red", "has capitals"),
    ("my token=red", "holds a space"),
    ("<p.1>=red", "holds a space, comma, '.'"),
    ("<p1>=dark red", "is not one word"),
])
def test_a_badly_written_token_is_one_sentence(value, sentence):
    with pytest.raises(ConfigError, match=sentence):
        build_config(dict(pivotal_tokens=[value]))


def test_a_token_named_twice_and_a_text_cache_are_refused():
    with pytest.raises(ConfigError, match="named twice"):
        build_config(dict(pivotal_tokens=["<p1>=red", "<p1>=blue"]))
    with pytest.raises(ConfigError, match="cannot be combined with pivotal_tokens"):
        build_config(dict(pivotal_tokens=["<p1>=red"], cache_text_embeddings=True))
    with pytest.raises(ConfigError, match="<p1>_1 is also the extra vector <p1>_1 of <p1>"):
        build_config(dict(pivotal_tokens=["<p1>=red", "<p1>_1=dog"], num_vectors_per_token=2))
    config = build_config(dict(pivotal_tokens=["<p1>=red"], num_vectors_per_token=2))
    assert config.pivotal_tokens == ["<p1>=red"] and config.embedding_train_fraction == 1.0


def test_the_knobs_reach_the_cli_and_the_ui_schema():
    """A command line sets the config the run gets; the WebUI's committed schema (read without torch) gives each
    knob the type, default and range the config has, so a form value becomes the same config."""
    import argparse

    from stabletune_core.config import TrainConfig, add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--pivotal_tokens", "<p1>=red", "<p2>=dog", "--embedding_lr", "5e-3",
                              "--num_vectors_per_token", "2", "--embedding_train_fraction", "0.5",
                              "--pretrained_model_name_or_path", "m", "--train_data_dir", "d", "--output_dir", "o"])
    config = config_from_args(args)
    assert config.pivotal_tokens == ["<p1>=red", "<p2>=dog"] and config.embedding_lr == 5e-3
    assert config.num_vectors_per_token == 2 and config.embedding_train_fraction == 0.5
    fields = {f["name"]: f for f in json.loads((ROOT / "extension" / "config_schema.json").read_text())["fields"]}
    defaults = TrainConfig.model_fields
    for knob in ("pivotal_tokens", "num_vectors_per_token", "embedding_lr", "embedding_train_fraction"):
        assert fields[knob]["default"] == defaults[knob].default, knob
    assert (fields["num_vectors_per_token"]["min"], fields["num_vectors_per_token"]["max"]) == (1, 16)
    for outside in (0, 17):  # the form's range is the config's: a value the form refuses, the run refuses too
        with pytest.raises(ConfigError):
            build_config(dict(pivotal_tokens=["<p1>=red"], num_vectors_per_token=outside))


def test_the_form_shows_the_knobs_in_the_lora_group_and_reads_several_tokens():
    from extension.form import Form, display_value
    from extension.schema import schema_from_config

    fields = {f["name"]: f for f in schema_from_config()}
    for knob in ("pivotal_tokens", "num_vectors_per_token", "embedding_lr", "embedding_train_fraction"):
        assert fields[knob]["group"] == "lora" and fields[knob]["ui"]
    tokens = fields["pivotal_tokens"]
    assert Form.parse(tokens, "<p1>=red, <p2>=dog") == ["<p1>=red", "<p2>=dog"]  # commas never occur in a token
    assert display_value(tokens, ["<p1>=red", "<p2>=dog"]) == "<p1>=red, <p2>=dog"


@pytest.mark.parametrize("token, sentence", [
    ("sks=red", "'sks' is already a token of the model's vocabulary"),
    ("<p1>=blabbergasty", "the init word 'blabbergasty' of <p1> is 5 tokens"),
])
def test_a_token_that_is_not_new_or_an_init_word_of_several_tokens_is_refused_before_loading(
        token, sentence, tiny_model, token_dataset, tmp_path, monkeypatch):
    from stabletune_core.train import setup as setup_module

    def no_load(config):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(setup_module, "load_model", no_load)
    config = build_config(dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(token_dataset),
                               output_dir=str(tmp_path / "run"), pivotal_tokens=[token]))
    with pytest.raises(ConfigError, match=sentence):
        setup_module.setup(config)
    assert not (tmp_path / "run").exists()  # nothing written


def test_flux2_klein_is_refused_in_one_sentence(tmp_path):
    """By the family's knob rules (config/families.py): named, when the config is built; detected (auto), by the
    same rule the set-up applies before anything loads."""
    from stabletune_core.config.families import family_problems
    from stabletune_core.models.loading import family_name

    klein = tmp_path / "klein"
    klein.mkdir()
    (klein / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    values = dict(pretrained_model_name_or_path=str(klein), pivotal_tokens=["<p1>=red"])
    with pytest.raises(ConfigError, match="pivotal_tokens .*FLUX.2 Klein's Qwen3 text encoder has no CLIP token"):
        build_config({**values, "model_family": "flux2_klein"})
    config = build_config(values)
    problems = family_problems(config, family_name(config))
    assert len(problems) == 1 and "pivotal_tokens" in problems[0] and "FLUX.2 Klein" in problems[0], problems


def test_multi_vector_tokens_are_written_out_in_prompts_as_diffusers_does():
    from stabletune_core.models.tokenizer import build_clip_tokenizer, expand_multi_vector

    tok = build_clip_tokenizer()
    assert expand_multi_vector(tok, ["a <p1> circle"]) == ["a <p1> circle"]  # no added tokens: unchanged
    tok.add_tokens(["<p1>", "<p1>_1", "<p1>_2"])
    assert expand_multi_vector(tok, ["a <p1> circle", "a red square"]) == ["a <p1> <p1>_1 <p1>_2 circle",
                                                                          "a red square"]


# ---- training, freezing, files, resume ----------------------------------------------------------------------------
def test_only_the_new_rows_train_then_freeze_and_the_files_hold_them(tiny_config, tiny_model, token_dataset, tmp_path,
                                                                     one_thread):
    from transformers import CLIPTextModel

    from stabletune_core.train.checkpoint import load_checkpoint
    from stabletune_core.train.loop import train
    from stabletune_core.train.setup import setup

    config = tiny_config(train_data_dir=str(token_dataset), output_dir=str(tmp_path / "run"), max_train_steps=6,
                         save_steps=2, pivotal_tokens=["<p1>=red"], num_vectors_per_token=2, embedding_lr=5e-2,
                         embedding_train_fraction=0.5, **COMMON)
    session = setup(config)
    table = session.bundle.text_encoders[0].get_input_embeddings()
    original = CLIPTextModel.from_pretrained(str(tiny_model), subfolder="text_encoder").get_input_embeddings().weight
    red = session.bundle.tokenizers[0]("red", add_special_tokens=False).input_ids[0]
    start = table.new_rows.detach().clone()
    assert torch.equal(start, original[[red, red]].detach())  # both vectors start from "red"
    path = train(config, session=session)

    assert torch.equal(table.base.weight, original)  # the vocabulary's table, bitwise untouched
    at = {step: load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:06d}").adapter["pivotal.te0"]
          for step in (2, 4)}
    assert not torch.equal(at[2], start)  # trained while the LoRA trained ...
    assert torch.equal(at[4], table.new_rows.detach())  # ... and frozen from step 3 (0.5 of 6) to the end
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert "freeze at step 3" in events

    lora = load_file(path)
    bundled = lora["bundle_emb.<p1>.string_to_param.*"]
    assert bundled.shape == (2, table.new_rows.shape[1]) and torch.equal(bundled, table.new_rows.detach())
    assert any(k.startswith("lora_unet_") for k in lora)  # the LoRA is still all there
    embedding = load_file(tmp_path / "run" / "output" / "lora_embeddings" / "p1.safetensors")
    assert list(embedding) == ["emb_params"] and torch.equal(embedding["emb_params"], bundled)


def test_a_pivotal_run_resumes_bitwise(tiny_config, token_dataset, tmp_path, one_thread):
    from stabletune_core.train.loop import train

    common = dict(train_data_dir=str(token_dataset), max_train_steps=4, save_steps=2, pivotal_tokens=["<p1>=red"],
                  embedding_lr=5e-2, embedding_train_fraction=0.75, train_text_encoder=True, **COMMON)
    train(tiny_config(output_dir=str(tmp_path / "straight"), **common))
    train(tiny_config(output_dir=str(tmp_path / "resumed"), **common,
                      resume_from_checkpoint=str(tmp_path / "straight" / "checkpoints" / "step_000002")))
    a, b = (load_file(tmp_path / run / "output" / "lora.safetensors") for run in ("straight", "resumed"))
    assert "bundle_emb.<p1>.string_to_param.*" in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_other_tokens_is_refused(tiny_config, token_dataset, tmp_path, one_thread):
    from stabletune_core.train.loop import train

    common = dict(train_data_dir=str(token_dataset), output_dir=str(tmp_path / "run"), save_steps=2, **COMMON)
    train(tiny_config(**common, max_train_steps=2, pivotal_tokens=["<p1>=red"]))
    with pytest.raises(ConfigError, match="pivotal_tokens <p1>=red"):
        train(tiny_config(**common, max_train_steps=4, resume_from_checkpoint="auto"))


def test_sdxl_gets_rows_in_both_encoders_as_clip_l_and_clip_g(tmp_path, token_dataset, small_config, one_thread):
    from stabletune_core.models.sd.tiny import build_tiny_sdxl
    from stabletune_core.train.loop import train

    model = build_tiny_sdxl(tmp_path / "xl", seed=0)
    config = small_config(model, tmp_path / "run", train_data_dir=str(token_dataset), max_train_steps=2,
                          pivotal_tokens=["<p1>=red"], num_vectors_per_token=2, **COMMON)
    lora = load_file(train(config))
    l, g = lora["bundle_emb.<p1>.clip_l"], lora["bundle_emb.<p1>.clip_g"]
    assert l.shape[0] == g.shape[0] == 2 and l.shape[1] != g.shape[1]  # each encoder's own width
    embedding = load_file(tmp_path / "run" / "output" / "lora_embeddings" / "p1.safetensors")
    assert set(embedding) == {"clip_l", "clip_g"} and torch.equal(embedding["clip_g"], g)


# ---- the concept, learned -----------------------------------------------------------------------------------------
def test_the_new_token_learns_the_concept_on_the_toy_base(toy_base, tmp_path, one_thread):
    """<p1> starts as "red" (its embedding is red's, the LoRA starts at zero: the images of "a <p1> SHAPE" are the
    base's red ones) and, trained on the demo's purple images captioned "a <p1> SHAPE", ends near their hue while
    the base's own colours stay where they were. 8 render seeds; bench/pivotal_toy.py has the full comparison."""
    from stabletune_core.demo import DEMO_IMAGES
    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.world import CONCEPT_COLOR, base_scenes, concept_scenes, write_dataset

    bench = load_bench("pivotal_toy")
    demo_data = tmp_path / "demo"  # the demo's dataset, as demo.demo_assets writes it
    write_dataset(demo_data / f"1_{CONCEPT_COLOR}", concept_scenes(DEMO_IMAGES))
    write_dataset(demo_data / "1_known_colours", base_scenes(12 * TOY_BASES["sd1"].prior_images_per_prompt, seed=78))
    data, target = bench.concept_dataset(demo_data, tmp_path / "data")
    output = bench.train_run(toy_base, data, tmp_path / "run", seed=1, steps=150, pivotal=True, init="red")
    seeds = list(range(bench.FIRST_RENDER_SEED, bench.FIRST_RENDER_SEED + 8))
    base = bench.lora_pipeline(toy_base, None)
    tuned = bench.lora_pipeline(toy_base, output)

    def concept_error(pipe, word):
        images = [img for i, seed in enumerate(seeds)
                  for img in bench.render(pipe, f"a {word} {bench.SHAPES[i % 3]}", [seed])]
        return sum(bench.hue_distance(bench.hue_of(img), target) for img in images) / len(images)

    before, after = concept_error(base, "red"), concept_error(tuned, bench.TOKEN)
    assert after < 50 and after < before / 2, (before, after)
    drift = [bench.hue_distance(bench.hue_of(a), bench.hue_of(b))
             for prompt in bench.BASE_PROMPTS[:2] for a, b in zip(bench.render(base, prompt, seeds[:4]),
                                                                   bench.render(tuned, prompt, seeds[:4]))]
    assert sum(drift) / len(drift) < 12, drift


# ---- what the WebUIs read ---------------------------------------------------------------------------------------
def webui_bundled_embeddings(lora: dict[str, torch.Tensor]) -> dict[str, dict]:
    """A1111's rule for embeddings bundled in a LoRA (extensions-builtin/Lora/networks.py, load_network; read at
    AUTOMATIC1111/stable-diffusion-webui 1.10, added in 1.7.0 by PR #13568), re-stated:
    a key is split at its first '.', the part before must be 'bundle_emb'; the rest splits at its first '.' into the
    embedding's name and its vector name; 'string_to_param.<k>' becomes {'string_to_param': {k: tensor}}."""
    found: dict[str, dict] = {}
    for key, weight in lora.items():
        head, _, rest = key.partition(".")
        if head != "bundle_emb":
            continue
        name, vec_name = rest.split(".", 1)
        entry = found.setdefault(name, {})
        if vec_name.split(".")[0] == "string_to_param":
            entry["string_to_param"] = {vec_name.split(".", 1)[1]: weight}
        else:
            entry[vec_name] = weight
    return found


def webui_vectors(data: dict) -> torch.Tensor | dict[str, torch.Tensor]:
    """A1111's create_embedding_from_data (modules/textual_inversion), re-stated: a string_to_param with exactly one
    tensor; or clip_l and clip_g (SDXL); or a dict of exactly one tensor (a .safetensors embedding file)."""
    if "string_to_param" in data:
        assert len(data["string_to_param"]) == 1
        return next(iter(data["string_to_param"].values()))
    if "clip_g" in data and "clip_l" in data:
        assert data["clip_g"].shape[0] == data["clip_l"].shape[0]  # one vector count for both encoders
        return {k: data[k] for k in ("clip_l", "clip_g")}
    assert len(data) == 1
    return next(iter(data.values()))


def comfy_vectors(data: dict, embed_key: str) -> torch.Tensor:
    """ComfyUI's load_embed (comfy/sd1_clip.py), re-stated for a .safetensors file: string_to_param's first tensor,
    else the tensor under the encoder's key ('clip_l' for SD1's and SDXL's first encoder, 'clip_g' for SDXL's
    second) when the file has it, else the file's first tensor."""
    if "string_to_param" in data:
        return next(iter(data["string_to_param"].values()))
    return data[embed_key] if embed_key in data else next(iter(data.values()))


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_the_files_load_by_the_webuis_rules(family, tmp_path, token_dataset, small_config, one_thread):
    from stabletune_core.models.sd import tiny
    from stabletune_core.train.loop import train

    model = getattr(tiny, f"build_tiny_{family}")(tmp_path / "model", seed=0)
    config = small_config(model, tmp_path / "run", train_data_dir=str(token_dataset), max_train_steps=1,
                          pivotal_tokens=["<p1>=red", "<p2>=dog"], num_vectors_per_token=3, **COMMON)
    lora = load_file(train(config))
    bundled = {name: webui_vectors(data) for name, data in webui_bundled_embeddings(lora).items()}
    assert set(bundled) == {"<p1>", "<p2>"}  # A1111 names them as typed in the prompt
    for token in ("p1", "p2"):
        data = load_file(tmp_path / "run" / "output" / "lora_embeddings" / f"{token}.safetensors")
        file_vectors, in_lora = webui_vectors(data), bundled[f"<{token}>"]
        if family != "sdxl":  # one text encoder: string_to_param / emb_params
            assert file_vectors.shape[0] == 3 and torch.equal(file_vectors, in_lora)
            assert torch.equal(comfy_vectors(data, "clip_l"), in_lora)
        else:
            assert all(torch.equal(file_vectors[k], in_lora[k]) for k in ("clip_l", "clip_g"))
            assert torch.equal(comfy_vectors(data, "clip_l"), in_lora["clip_l"])
            assert torch.equal(comfy_vectors(data, "clip_g"), in_lora["clip_g"])


def test_diffusers_reads_the_lora_without_bundle_emb_and_the_embedding_file(tiny_model, token_dataset, tiny_config,
                                                                            tmp_path, one_thread):
    """diffusers' load_lora_weights refuses a file with bundle_emb.* keys (README says so); its tensors without them,
    and the embedding file through load_textual_inversion, load, and <p1> then means the trained vectors."""
    from diffusers import StableDiffusionPipeline

    from stabletune_core.train.loop import train

    path = train(tiny_config(train_data_dir=str(token_dataset), max_train_steps=1, pivotal_tokens=["<p1>=red"],
                             num_vectors_per_token=2, **COMMON))
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None, requires_safety_checker=False)
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(str(path.parent), weight_name=path.name)
    lora = load_file(path)
    pipe.load_lora_weights({k: v for k, v in lora.items() if not k.startswith("bundle_emb.")})
    pipe.load_textual_inversion(str(path.parent / "lora_embeddings" / "p1.safetensors"), token="<p1>")
    ids = pipe.tokenizer.convert_tokens_to_ids(["<p1>", "<p1>_1"])
    table = pipe.text_encoder.get_input_embeddings().weight
    assert torch.equal(table[ids].detach(), lora["bundle_emb.<p1>.string_to_param.*"].float())


def test_the_grid_and_the_export_command_use_the_checkpoints_token_rows(tiny_config, token_dataset, tmp_path,
                                                                        one_thread):
    import numpy as np
    from PIL import Image

    from stabletune_core import cli
    from stabletune_core.grid import render_grid
    from stabletune_core.runs.layout import RunPaths
    from stabletune_core.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(train_data_dir=str(token_dataset), output_dir=str(run), max_train_steps=4, save_steps=2,
                      pivotal_tokens=["<p1>=red"], embedding_lr=5e-2, validation_prompt="a <p1> circle",
                      num_validation_images=1, validation_inference_steps=3, validation_steps=2, **COMMON))
    png = render_grid(run, checkpoints=["2"], strengths=[1.0], name="check", say=lambda *a: None)
    meta = json.loads(png.with_suffix(".json").read_text())
    sheet = Image.open(png).convert("RGB")
    for c in meta["cells"]:  # the base column is step 0 (<p1> = red), strength 1 at step 2 is step 2's image
        step = 0 if c["checkpoint"] is None else 2
        reference = np.asarray(Image.open(RunPaths(run).sample_dir(step) / f"p00_s{c['seed']}.png").convert("RGB"),
                               dtype=int)
        shown = np.asarray(sheet.crop(c["box"]).resize(reference.shape[1::-1], Image.NEAREST), dtype=int)
        assert np.abs(shown - reference).max() <= 1, c
    assert cli.main(["export", str(run / "checkpoints" / "step_000002"), "--name", "at2"]) == 0
    exported = load_file(run / "output" / "at2.safetensors")
    from stabletune_core.train.checkpoint import load_checkpoint

    rows = load_checkpoint(run / "checkpoints" / "step_000002").adapter["pivotal.te0"]
    assert torch.equal(exported["bundle_emb.<p1>.string_to_param.*"], rows)  # save_precision fp32


def test_resize_keeps_the_bundled_words(tiny_config, token_dataset, tmp_path, one_thread):
    from stabletune_core.lora.resize import resize_file
    from stabletune_core.train.loop import train

    path = train(tiny_config(train_data_dir=str(token_dataset), max_train_steps=1, pivotal_tokens=["<p1>=red"],
                             **COMMON))
    resized, _ = resize_file(path, rank=2)
    before, after = load_file(path), load_file(resized)
    key = "bundle_emb.<p1>.string_to_param.*"
    assert torch.equal(before[key], after[key])
    assert all(v.shape[0] == 2 for k, v in after.items() if k.endswith("lora_down.weight"))


def test_the_cli_refuses_a_word_of_the_vocabulary_in_one_sentence(tiny_model, token_dataset, tmp_path):
    """The CLI contract: one sentence, status.json `failed` with it, a non-zero exit, no traceback."""
    import os
    import subprocess

    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "stabletune_core", "train", "--pretrained_model_name_or_path",
                             str(tiny_model), "--train_data_dir", str(token_dataset), "--output_dir", str(run),
                             "--resolution", "64", "--pivotal_tokens", "<p1>=red", "sks=red"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "'sks' is already a token of the model's vocabulary" in errors[0], result.stderr
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "'sks' is already a token" in status["error"]


def test_merge_carries_the_words_into_a_merged_lora_and_says_a_checkpoint_has_none(tiny_model, tiny_config,
                                                                                  token_dataset, tmp_path, one_thread):
    from stabletune_core.tools.merge import merge_checkpoint, merge_loras
    from stabletune_core.train.loop import train

    files = {}
    for word in ("<p1>", "<p2>"):
        run = tmp_path / word.strip("<>")
        files[word] = train(tiny_config(train_data_dir=str(token_dataset), output_dir=str(run), max_train_steps=1,
                                        pivotal_tokens=[f"{word}=red"], **COMMON))
    merge_loras([(files["<p1>"], 0.5), (files["<p2>"], 0.5)], tmp_path / "both.safetensors", rank=4)
    merged = load_file(tmp_path / "both.safetensors")
    for word in ("<p1>", "<p2>"):
        key = f"bundle_emb.{word}.string_to_param.*"
        assert torch.equal(merged[key], load_file(files[word])[key])  # a word keeps its meaning, unscaled
    with pytest.raises(ConfigError, match="both bundle the word <p1>"):
        merge_loras([(files["<p1>"], 0.5), (files["<p1>"], 0.5)], tmp_path / "twice.safetensors", rank=4)
    said = merge_checkpoint(str(tiny_model), [(files["<p1>"], 1.0)], tmp_path / "merged")
    assert "The words <p1> of lora.safetensors (bundle_emb) are not part of a checkpoint" in said


def test_inspect_names_the_bundled_words(tiny_config, token_dataset, capsys, one_thread):
    from stabletune_core import cli
    from stabletune_core.train.loop import train

    path = train(tiny_config(train_data_dir=str(token_dataset), max_train_steps=1, pivotal_tokens=["<p1>=red"],
                             **COMMON))
    capsys.readouterr()
    assert cli.main(["inspect", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    modules = {k.rsplit(".", 2)[0] for k in load_file(path) if not k.startswith("bundle_emb.")}
    assert line.endswith(f"{len(modules)} LoRA modules, the words <p1> (bundle_emb)"), line


def test_sdxl_pools_at_the_end_token_not_at_a_new_token(tmp_path):
    """transformers pools CLIP at argmax(ids) when a config says eos_token_id 2 (SDXL's, SD1.5's): a new token's id
    is the largest, so without the fix the pooled text embedding of "a <p1> circle" would be read at <p1>."""
    from stabletune_core.lora.pivotal import add_pivotal_tokens
    from stabletune_core.models import get_family
    from stabletune_core.models.sd.tiny import build_tiny_sdxl

    bundle = get_family("sdxl").load(str(build_tiny_sdxl(tmp_path / "xl", seed=0)))
    tok, te = bundle.tokenizers[1], bundle.text_encoders[1]
    assert te.config.eos_token_id == 2  # the legacy value the fix is for

    def pooled(prompt):
        ids = tok([prompt], padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
        with torch.no_grad():
            out = te(ids, output_hidden_states=True)
            at_end = out.last_hidden_state[0, int((ids[0] == tok.eos_token_id).int().argmax())]
        return out.text_embeds[0], te.text_projection(at_end)

    before, _ = pooled("a red circle")
    add_pivotal_tokens(bundle, build_config(dict(pivotal_tokens=["<p1>=red"])))
    after, _ = pooled("a red circle")
    assert torch.equal(before, after)  # a prompt without the new word pools as before
    got, expected = pooled("a <p1> circle")
    assert torch.allclose(got, expected)


def test_the_export_command_writes_every_file_the_run_writes_for_a_step_and_no_users_file(tiny_config,
                                                                                           token_dataset, one_thread):
    """Issue 37 left: the export copied only NAME.safetensors out of its scratch folder; the EMA's file, the words'
    folder, Forge's file and the diffusers folder were lost. 13 SD words: past Forge's limit, so a _forge file."""
    from stabletune_core import cli
    from stabletune_core.train.loop import train

    words = [f"<p{i}>={w}" for i, w in enumerate(["red", "dog", "blue", "cat", "green", "car", "tree", "house",
                                                  "sky", "man", "woman", "water", "sun"], 1)]
    run = Path(tiny_config(train_data_dir=str(token_dataset)).output_dir)
    train(tiny_config(train_data_dir=str(token_dataset), max_train_steps=2, save_steps=2, pivotal_tokens=words,
                      ema_decay=0.9, export_diffusers_format=True, **COMMON))
    output = run / "output"

    def files(stem: str) -> dict[str, Path]:  # the step's files by their name after the stem
        return {str(p.relative_to(output))[len(stem):]: p for p in sorted(output.glob(f"{stem}*"))
                for p in ([p] if p.is_file() else sorted(p.rglob("*")))}

    by_run = files("lora")
    assert {"-ema.safetensors", "_forge.safetensors", "-ema_forge.safetensors", "_embeddings/p1.safetensors",
            "_diffusers/pytorch_lora_weights.safetensors"} <= by_run.keys()
    user_file = output / "at2_embeddings"
    user_file.mkdir()
    (user_file / "mine.txt").write_text("the user's")
    assert cli.main(["export", str(run / "checkpoints" / "step_000002"), "--name", "at2"]) == 2
    assert sorted(p.name for p in output.iterdir() if p.name.startswith("at2")) == ["at2_embeddings"]
    assert [p.name for p in user_file.iterdir()] == ["mine.txt"]
    shutil.rmtree(user_file)
    assert cli.main(["export", str(run / "checkpoints" / "step_000002"), "--name", "at2"]) == 0
    exported = files("at2")
    assert exported.keys() == by_run.keys()
    for part, path in by_run.items():
        if path.suffix == ".safetensors":  # the same tensors (the metadata holds the time of writing)
            again, final = load_file(exported[part]), load_file(path)
            assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final), part


def test_an_export_that_fails_halfway_leaves_nothing_of_its_own_and_can_be_run_again(tmp_path, monkeypatch):
    """The export places its files one by one: a full disk at the words' folder removes the LoRA it had placed
    already (so 'run the same export again' is not refused as 'already exists'), and never touches a user's file."""
    import errno

    from stabletune_core import cli

    made, output = tmp_path / "scratch", tmp_path / "output"
    (made / "at2_embeddings").mkdir(parents=True)
    output.mkdir()
    for path in (made / "at2.safetensors", made / "at2-ema.safetensors", made / "at2_embeddings" / "p1.safetensors"):
        path.write_bytes(path.name.encode())
    (output / "mine.safetensors").write_bytes(b"the user's")
    written = [made / "at2.safetensors", made / "at2-ema.safetensors", made / "at2_embeddings"]

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", full_disk)
    with pytest.raises(OSError):
        cli.place_exported(written, output)
    assert sorted(p.name for p in output.iterdir()) == ["mine.safetensors"]  # no temporaries either
    monkeypatch.undo()
    cli.place_exported(written, output)
    assert (output / "at2_embeddings" / "p1.safetensors").read_bytes() == b"p1.safetensors"
    assert sorted(p.name for p in output.iterdir()) == ["at2-ema.safetensors", "at2.safetensors", "at2_embeddings",
                                                        "mine.safetensors"]
