"""#13.10 "Sample now": the Train tab asks the engine to render the validation prompts at the current step;
the run's randomness is untouched, so the LoRA ends bitwise equal to a run that was never sampled."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from extension.tabs import train as train_tab
from stabletune_core.runs.reader import RunReader


def _run(small_config, tiny_model: Path, output: Path, *, ask_for_sample: bool, **overrides) -> Path:
    from stabletune_core.train.loop import setup, train

    config = small_config(tiny_model, output, max_train_steps=6, lora_dropout=0.2, train_text_encoder=True,
                          validation_steps=1000, num_validation_images=1, validation_inference_steps=2,
                          **overrides)
    session = setup(config)
    if ask_for_sample:
        RunReader(output).send("sample")  # what the Train tab's button writes; taken after the first step
    return train(config, session=session)


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_sample_now_renders_at_the_current_step_and_leaves_the_run_bitwise_equal(small_config, tiny_model,
                                                                                 tmp_path, one_thread):
    sampled = _run(small_config, tiny_model, tmp_path / "sampled", ask_for_sample=True,
                   validation_prompt="a red circle")
    plain = _run(small_config, tiny_model, tmp_path / "plain", ask_for_sample=False,
                 validation_prompt="a red circle")

    def steps(run: str) -> set[str]:
        return {p.name for p in (tmp_path / run / "samples").iterdir() if sorted(p.glob("*.png"))}

    extra = steps("sampled") - steps("plain")
    assert len(extra) == 1, (steps("sampled"), steps("plain"))
    assert 0 < int(extra.pop().removeprefix("step_")) < 6
    a, b = load_file(sampled), load_file(plain)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "sampling on request changed the training"


def test_sample_now_without_a_validation_prompt_says_why(small_config, tiny_model, tmp_path, one_thread, capsys):
    _run(small_config, tiny_model, tmp_path / "run", ask_for_sample=True, validation_prompt="")
    said = [e["message"] for e in _events(tmp_path / "run") if e["kind"] == "samples"]
    assert said and "no validation prompt" in said[0]
    assert "no validation prompt" in capsys.readouterr().err


def test_sample_now_button_is_there_only_while_a_run_is_live():
    assert dict(train_tab.CONTROLS)["sample"] == "Sample now"
    assert "sample" in train_tab.BUTTONS
    assert train_tab.buttons_for({"alive": True, "state": "training"}, False)["sample"]
    assert train_tab.buttons_for({"alive": True, "state": "paused"}, False)["sample"]
    assert not train_tab.buttons_for({"alive": False, "state": "stopped"}, True)["sample"]
