"""Mixed precision and the learning rate are the engine's own (issue 14.3): no private attribute of accelerate or
of torch's schedulers is touched, the fp16 fallback runs (on the CPU too), the scaler's state survives a
checkpoint, and a rate lowered for good survives a resume bit for bit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers.optimization import get_scheduler

import stabletune_core
from stabletune_core.runs.reader import RunReader
from stabletune_core.train import faults
from stabletune_core.train.amp import MixedPrecision
from stabletune_core.train.guards import precision
from stabletune_core.train.lr_schedule import LearningRateSchedule

#: What the fp16 fallback and the rate lowering used to rewrite: accelerate's private state, the optimizer list
#: and forward wrapper it keeps, and the scheduler's base and last rates.
PRIVATE = ("_mixed_precision", "_optimizers", "_original_forward", "base_lrs", "_last_lr")


@pytest.fixture
def injected():
    yield faults.install
    faults.install(None)


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run_dir).events() if e["kind"] == kind]


def lora_tensors(s) -> list[torch.Tensor]:
    return [p.detach().clone() for p in s.params]


# ---- no private attributes -----------------------------------------------------------------------------------
def test_the_engine_names_no_private_attribute_of_accelerate_or_of_torch_schedulers():
    root = Path(stabletune_core.__file__).parent
    pattern = re.compile(r"\b(" + "|".join(PRIVATE) + r")\b")
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_the_accelerator_runs_without_mixed_precision_and_our_object_owns_it(tiny_config):
    from stabletune_core.train.loop import setup

    s = setup(tiny_config(mixed_precision="fp16", max_train_steps=1))
    assert s.ranks.accelerator.mixed_precision == "no" and s.ranks.accelerator.scaler is None  # accelerate wraps nothing
    assert s.amp.precision == "fp16" and s.amp.loss_scale == 2.0**16
    with s.amp.autocast():
        assert torch.get_autocast_dtype(s.device.type) == torch.float16


def test_a_precision_the_device_cannot_run_is_refused_in_one_sentence():
    from stabletune_core.config import ConfigError

    with pytest.raises(ConfigError, match="mixed_precision fp16 is not available on meta; choose"):
        MixedPrecision("fp16", "meta")
    assert MixedPrecision("no", "meta").autocast() is not None  # fp32 needs nothing from the device


# ---- the scaler's state ----------------------------------------------------------------------------------------
def test_the_scaler_state_round_trips_reads_accelerates_checkpoints_and_goes_with_a_fallback():
    amp = MixedPrecision("fp16", "cpu")
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for value in (1.0, float("inf"), 1.0, 1.0):  # an overflow halves the scale; good steps count towards growth
        param.grad = None
        amp.scale((param * value).sum()).backward()
        amp.unscale_(optimizer)
        amp.step(optimizer)
    assert torch.allclose(param.detach(), torch.full((3,), 0.7))  # three steps of 0.1: the overflowing one skipped
    state = amp.state_dict()
    assert state["scale"] == 2.0**15 and state["_growth_tracker"] == 2

    again = MixedPrecision("fp16", "cpu")
    again.load_state_dict(state)
    assert again.state_dict() == state
    # accelerate saved torch's own GradScaler state under the checkpoint's "scaler": it loads as it is
    again.load_state_dict(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict())
    assert again.loss_scale == 1024.0

    param.grad = None  # a guard skips the step: the scaler still learns (halves) and is ready for the next one
    again.scale((param * float("inf")).sum()).backward()
    again.unscale_(optimizer)
    again.skip()
    assert again.loss_scale == 512.0
    again.unscale_(optimizer)  # no "unscale_() has already been called" from a half-finished step
    again.skip()

    again.switch_to("bf16")
    assert again.state_dict() == {} and again.loss_scale is None and again.scaler is None
    again.load_state_dict(state)  # a scaler state after the fallback is not needed
    assert again.scaler is None and again.scale(torch.tensor(2.0)) == 2.0
    with again.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


# ---- the fp16 fallback, on the CPU ---------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["no", "bf16"])
def test_fp16_that_keeps_overflowing_falls_back_and_a_resumed_run_continues_exactly(tiny_config, tmp_path,
                                                                                    monkeypatch, one_thread,
                                                                                    injected, target):
    """The fp16 backward passes of steps 2, 3 and 4 overflow (the UNet output's gradient is inf, found by the
    scaler; a rate of 1.0 did it by itself on the CPU this test was written on, not on an AMD EPYC without
    AVX-512). After three in a row the run switches to `target` ('no' is what a CPU picks, 'bf16' what a bf16 GPU picks), drops the scaler
    and trains on finite at that rate; resumed from a checkpoint after the switch, it switches again and ends
    bitwise equal to the uninterrupted run."""
    from stabletune_core.train.loop import setup, train

    monkeypatch.setattr(precision, "fallback_precision", lambda: target)
    injected("fp16_overflow@2,fp16_overflow@3,fp16_overflow@4")
    dtype = torch.bfloat16 if target == "bf16" else torch.float32
    common = dict(mixed_precision="fp16", learning_rate=1.0, clip_mode="off", fp16_max_skips=3, max_train_steps=7,
                  save_steps=5)
    full = tiny_config(**common, output_dir=str(tmp_path / "full"))
    s = setup(full)
    train(full, session=s)
    run_dir = Path(full.output_dir)
    (switch,) = [e for e in events_of(run_dir, "precision") if e.get("precision")]
    assert switch["precision"] == target and switch["step"] == 4
    assert [e["step"] for e in events_of(run_dir, "fp16_overflow")] == [2, 3, 4]
    assert s.amp.precision == target and s.amp.scaler is None and s.amp.weight_dtype == dtype
    assert {p.dtype for n, p in s.bundle.denoiser.named_parameters() if "lora_" not in n} == {dtype}
    assert {p.dtype for p in s.params} == {torch.float32}
    metrics = RunReader(run_dir).metrics()
    assert [m["loss_scale"] for m in metrics[:4]] == [2.0**16, 2.0**15, 2.0**14, 2.0**13]
    assert all("loss_scale" not in m for m in metrics[4:])
    assert all(isinstance(m["grad_norm"], float) and m["grad_norm"] == m["grad_norm"] for m in metrics[4:])
    assert all(torch.isfinite(p).all() for p in s.params)

    resumed = tiny_config(**common, output_dir=str(tmp_path / "resumed"),
                          resume_from_checkpoint=str(run_dir / "checkpoints" / "step_000005"))
    r = setup(resumed)
    assert r.amp.precision == "fp16"  # the config says fp16; the guard's state says it fell back
    train(resumed, session=r)
    assert r.amp.precision == target and r.amp.scaler is None
    assert "Continuing in" in events_of(Path(resumed.output_dir), "precision")[-1]["message"]
    assert all(torch.equal(a, b) for a, b in zip(lora_tensors(s), lora_tensors(r)))


# ---- the learning rate, lowered for good ---------------------------------------------------------------------
def test_a_rate_lowered_for_good_survives_checkpoint_and_resume_bitwise(tiny_config, tmp_path, injected,
                                                                       one_thread):
    """Two non-finite losses roll back and halve the rate at step 3, in the middle of a cosine schedule with a
    warm-up; a run resumed from the checkpoint of step 4 continues at the same halved rates and ends with the same
    LoRA, bit for bit, as the run that was never interrupted."""
    from stabletune_core.train.loop import setup, train

    common = dict(lr_scheduler="cosine", lr_warmup_steps=2, nan_max_bad=2, max_train_steps=7, save_steps=4,
                  learning_rate=1e-3)
    injected("nan_loss@2,nan_loss@3")
    full = tiny_config(**common, output_dir=str(tmp_path / "full"))
    s = setup(full)
    train(full, session=s)
    (rollback,) = events_of(Path(full.output_dir), "rollback")
    assert rollback["step"] == 3 and (rollback["old_lr"], rollback["new_lr"]) == pytest.approx((1e-3, 5e-4))
    assert s.lr_scheduler.factors == [0.5]

    # The rates the run used: the cosine shape itself (a schedule built alone), halved from step 3 on.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    shape = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=7)
    expected = []
    for step in range(1, 8):
        optimizer.step()
        shape.step()
        expected.append(shape.get_last_lr()[0] * (0.5 if step >= 3 else 1.0))
    lrs = [m["lr"] for m in RunReader(Path(full.output_dir)).metrics()]
    assert lrs == pytest.approx(expected, rel=1e-12)

    resumed = tiny_config(**common, output_dir=str(tmp_path / "resumed"),
                          resume_from_checkpoint=str(Path(full.output_dir) / "checkpoints" / "step_000004"))
    r = setup(resumed)
    train(resumed, session=r)
    assert r.lr_scheduler.factors == [0.5]
    assert [m["lr"] for m in RunReader(Path(resumed.output_dir)).metrics()] == lrs[4:]  # exactly the same floats
    assert all(torch.equal(a, b) for a, b in zip(lora_tensors(s), lora_tensors(r)))


def test_a_checkpoint_from_before_keeps_the_rate_it_had_lowered():
    """Before the schedule kept its own factors, a lowering rewrote the scheduler's base and last rates and the
    groups' initial rates; such a checkpoint still resumes at its lowered rates, and later lowerings start from
    its lowered peak."""
    def fresh() -> torch.optim.Optimizer:
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2)), ], lr=1e-2)

    old_optimizer = fresh()
    old = get_scheduler("cosine", optimizer=old_optimizer, num_warmup_steps=2, num_training_steps=10)
    for _ in range(3):
        old_optimizer.step()
        old.step()
    group = old_optimizer.param_groups[0]  # what the old guards/lr.py did, halving the rate
    group["lr"] *= 0.5
    group["initial_lr"] *= 0.5
    old.base_lrs[0] *= 0.5
    old._last_lr = [group["lr"]]

    optimizer = fresh()
    schedule = LearningRateSchedule(optimizer, lambda o: get_scheduler("cosine", optimizer=o, num_warmup_steps=2,
                                                                       num_training_steps=10))
    optimizer.load_state_dict(old_optimizer.state_dict())  # the loop loads the optimizer first
    schedule.load_state_dict(old.state_dict())
    assert schedule.get_last_lr() == old.get_last_lr() and schedule.peak_lrs() == [5e-3]
    for _ in range(4):
        old_optimizer.step()
        old.step()
        optimizer.step()
        schedule.step()
        assert schedule.get_last_lr() == old.get_last_lr() == [optimizer.param_groups[0]["lr"]]
    assert schedule.lower(0.5) == (5e-3, 2.5e-3)
