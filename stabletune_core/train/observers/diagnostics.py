"""Diagnostics observers: LoRA singular-value spectra and LoRA output statistics, every N steps.

Files under RUN/diagnostics/, one JSON object per line (the UI's Diagnostics tab reads spectra.jsonl):

spectra.jsonl      one line per LoRA module per evaluation:
                   {"step", "module", "block", "singular_values", "normalized", "effective_rank", "stable_rank",
                    "frobenius", "up_down_ratio"}   (module = "unet.<peft module name>" or "te0.<...>")
activations.jsonl  one line per LoRA module per evaluation, on a fixed probe (the first validation image, fixed
                   noise, timestep T/2, dropout off):
                   {"step", "module", "mean", "var", "zero_fraction", "near_zero_fraction", "relative_rms"}
                   of the LoRA path's output (scale * B A x); near zero = under 1e-3 x the RMS of the layer's
                   full output; relative_rms = RMS(LoRA output) / RMS(full output).

A "collapse" event is written when the second normalised singular value falls under collapse_threshold in
most modules, naming the first module (in network order) and its block; once, until it recovers.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from ...config import TrainConfig
from ...lora.layers import run_lora_layers
from ...lora.svd import Spectrum, block_of, detect_collapse, lora_factors, spectra
from ...runs import events
from ...runs.jsonfiles import append_jsonl
from ..guards.verdicts import Event
from .base import NOTHING, Observation, Observer, ObserverView
from .validation_loss import Evaluator, FixedSet

NEAR_ZERO = 1e-3


def all_spectra(adapters: Mapping[str, torch.nn.Module]) -> list[Spectrum]:
    """Spectra of every adapter of the run (unwrapped modules by checkpoint prefix), UNet first, in network order."""
    factors = []
    for prefix, module in adapters.items():
        factors.extend(lora_factors(module, prefix=f"{prefix}."))
    return spectra(factors)


class SpectralMonitor(Observer):
    name = "spectra"

    def __init__(self, config: TrainConfig) -> None:
        self.every = config.diagnostics_every
        self.threshold = config.collapse_threshold
        self.collapsed = False  # a warning was given and the adapters have not recovered since
        self.seconds = 0.0

    def observe(self, view: ObserverView) -> Observation:
        if not self.every or view.step % self.every:
            return NOTHING
        start = time.perf_counter()
        _, said = self.check(view)
        self.seconds += time.perf_counter() - start
        return Observation(events=said)

    def check(self, view: ObserverView) -> tuple[list[Spectrum], tuple[Event, ...]]:
        """The spectra (also appended to spectra.jsonl), and the collapse warning or recovery, if any."""
        found = all_spectra(view.adapters)
        step = view.step
        if view.run_paths is not None:
            path = view.run_paths.spectra
            for sp in found:
                append_jsonl(path, {"step": step, **sp.as_record(), "block": block_of(sp.module)})
        collapse = detect_collapse(found, self.threshold)
        said: tuple[Event, ...] = ()
        if collapse and not self.collapsed:
            said = (Event(events.COLLAPSE, f"Rank collapse at step {step}: in {collapse.collapsed} of "
                          f"{collapse.considered} LoRA modules the second singular value is under {self.threshold} "
                          f"of the first; it starts in block {collapse.first_block} ({collapse.first_module}). "
                          "Lower the learning rate or the rank, or raise alpha less.",
                          fields=dict(step=step, module=collapse.first_module, block=collapse.first_block,
                                      fraction=collapse.fraction)),)
        elif self.collapsed and not collapse:
            said = (Event(events.COLLAPSE_RECOVERED, f"LoRA spectra recovered at step {step}: most modules have a "
                          f"second direction above {self.threshold} again.", fields=dict(step=step)),)
        self.collapsed = collapse is not None
        return found, said

    def state_dict(self) -> dict[str, Any]:
        return {"collapsed": self.collapsed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collapsed = bool(state.get("collapsed", False))


class ActivationMonitor(Observer):
    """Statistics of each LoRA layer's adapter output on a fixed probe, through forward hooks on one forward."""

    name = "activations"

    def __init__(self, config: TrainConfig, evaluator: Evaluator) -> None:
        self.every = config.activation_stats_every
        self.evaluator = evaluator
        self.probe: FixedSet | None = None
        self.seconds = 0.0

    def probe_set(self) -> FixedSet:
        """The probe, built when first measured (not before step 1: the first measurement may be far off)."""
        if self.probe is None:
            start = time.perf_counter()
            items, _ = self.evaluator.items()
            self.probe = self.evaluator.fixed_set(items[:1], self.evaluator.objective.validation_timesteps(1),
                                                  purpose="probe")
            self.seconds += time.perf_counter() - start
        return self.probe

    def observe(self, view: ObserverView) -> Observation:
        if not self.every or view.step % self.every:
            return NOTHING
        start = time.perf_counter()
        records = self.measure(view)
        if view.run_paths is not None:
            path = view.run_paths.activations
            for record in records:
                append_jsonl(path, {"step": view.step, **record})
        self.seconds += time.perf_counter() - start
        return NOTHING

    @torch.no_grad()
    def measure(self, view: ObserverView) -> list[dict[str, Any]]:
        probe = self.probe_set()  # built before any hook is in place
        if not probe:
            return []
        layers = [(name, layer.module, layer.up_module, layer.scaling)
                  for name, layer in run_lora_layers(view.adapters)]
        captured: dict[str, dict[str, torch.Tensor]] = {}
        handles = []
        for name, layer, lora_b, scale in layers:
            def on_delta(_m, _i, out, name=name, scale=scale):
                captured.setdefault(name, {})["delta"] = out.detach().float() * scale

            def on_full(_m, _i, out, name=name):
                captured.setdefault(name, {})["full"] = out.detach().float()

            handles += [lora_b.register_forward_hook(on_delta), layer.register_forward_hook(on_full)]
        try:
            self.evaluator.probe_forward(probe)
        finally:
            for handle in handles:
                handle.remove()
        names, rows = [], []
        for name, _, _, _ in layers:
            got = captured.get(name, {})
            if "delta" not in got or "full" not in got:
                continue  # a text-encoder layer when only the UNet ran, or a layer the probe did not reach
            delta, full = got["delta"], got["full"]
            full_rms = full.pow(2).mean().sqrt()
            rows.append(torch.stack([delta.mean(), delta.var(unbiased=False), (delta == 0).float().mean(),
                                     (delta.abs() < NEAR_ZERO * full_rms).float().mean(),
                                     delta.pow(2).mean().sqrt() / full_rms.clamp_min(1e-30)]))
            names.append(name)
        if not rows:
            return []
        table = torch.stack(rows).cpu().tolist()  # one transfer
        keys = ("mean", "var", "zero_fraction", "near_zero_fraction", "relative_rms")
        return [{"module": name, "block": block_of(name), **dict(zip(keys, row))} for name, row in zip(names, table)]


def make_observers(config: TrainConfig, evaluator: Evaluator | None = None, perceptual: Any = None
                   ) -> list[Observer]:
    """The observers a config asks for, in order: validation loss, LPIPS report, spectra, activations, and the
    perceptual drift of the validation images (any run with validation prompts)."""
    from .perceptual_drift import PerceptualDrift
    from .perceptual_report import PerceptualReport
    from .validation_loss import ValidationLoss

    observers: list[Observer] = []
    if config.validation_loss_every:
        observers.append(ValidationLoss(config, evaluator))
    if config.perceptual_lambda > 0:
        observers.append(PerceptualReport(perceptual))
    if config.diagnostics_every:
        observers.append(SpectralMonitor(config))
    if config.activation_stats_every:
        observers.append(ActivationMonitor(config, evaluator))
    if config.validation_prompts and evaluator is not None:
        observers.append(PerceptualDrift(config, evaluator.bundle, evaluator.device, evaluator.data.items))
    return observers
