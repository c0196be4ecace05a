"""The memory plan (``vram_gb``): the cheapest settings with which a FLUX.2 Klein run fits a card of that size, by
the memory model of flux2_memory.py, chosen before any model loads.

Cheapest means least cost to speed and quality first. The ladder, each rung keeping the ones before it:

1. the settings as given;
2. text embeddings cached (Qwen3 runs once before training and leaves the GPU; nothing about training changes);
   then mixed_precision bf16 when the run would otherwise keep the frozen model in fp32 (Klein's own precision);
3. gradient checkpointing (about 20-30 % slower, the same numbers);
4. base_storage int8 (the frozen weights in 8 bits, close to bf16 in quality);
5. int8 with 1, 2, ... blocks swapped (copies overlap the compute; the more blocks, the more PCIe traffic);
6. base_storage nf4 with 0, 1, ... blocks swapped (4 bits: the larger quality cost);
7. then the micro-batch is halved (gradient accumulation doubled, so the effective batch stays) and the ladder
   climbed again.

A knob the user set (present in the config as given: a flag, a TOML key) is never changed; a rung that would change
it is skipped. When nothing fits, one sentence names the smallest plan and what it needs.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .flux2_memory import GIB, MemoryEstimate, config_memory_sentence, klein_sizes, variant_of


@dataclass(frozen=True)
class MemoryPlan:
    update: dict[str, Any]  # the knobs the plan set, as a model_copy update (empty: the settings fit as given)
    estimate: MemoryEstimate
    sentence: str  # the one console line


def _rungs(config: Any, blocks: int) -> Iterator[dict[str, Any]]:
    """Cumulative settings, cheapest first, at the config's micro-batch."""
    settings: dict[str, Any] = {}
    yield dict(settings)
    text_cache_allowed = not (config.shuffle_caption or config.caption_tag_dropout_rate or config.train_text_encoder
                              or config.pivotal_tokens)
    if text_cache_allowed:
        settings["cache_text_embeddings"] = True
        yield dict(settings)
    if config.mixed_precision == "no":
        settings["mixed_precision"] = "bf16"
        yield dict(settings)
    settings["gradient_checkpointing"] = True
    yield dict(settings)
    # a storage the user chose is kept and only blocks are swapped on top of it
    for storage in (config.base_storage,) if "base_storage" in config.model_fields_set else ("int8", "nf4"):
        settings["base_storage"] = storage
        for swapped in range(blocks + 1):
            settings["blocks_to_swap"] = swapped
            yield dict(settings)


def _allowed(config: Any, update: dict[str, Any]) -> bool:
    """Whether `update` changes only knobs the user left unset (a set knob may be kept at its own value)."""
    return all(name not in config.model_fields_set or getattr(config, name) == value
               for name, value in update.items())


def plan_memory(config: Any) -> MemoryPlan:
    """The plan for `config.vram_gb` GiB (a TrainConfig of a FLUX.2 Klein run); one sentence when no
    plan fits (ConfigError)."""
    budget = float(config.vram_gb)
    source = config.pretrained_model_name_or_path
    blocks = klein_sizes(variant_of(source) or "4b").blocks
    smallest: tuple[MemoryEstimate, dict[str, Any]] | None = None
    batch, accumulation = config.train_batch_size, config.gradient_accumulation_steps
    while True:
        for rung in _rungs(config, blocks):
            update = {name: value for name, value in rung.items() if getattr(config, name) != value}
            if batch != config.train_batch_size:
                update.update(train_batch_size=batch, gradient_accumulation_steps=accumulation)
            if not _allowed(config, update) or (update.get("blocks_to_swap") and not
                                                 rung.get("gradient_checkpointing", config.gradient_checkpointing)):
                continue
            planned = config.model_copy(update=update)
            sentence, estimate = config_memory_sentence(planned)
            if smallest is None or estimate.peak < smallest[0].peak:
                smallest = (estimate, update)
            if estimate.fits(budget):
                return MemoryPlan(update, estimate, _sentence(budget, update, sentence))
        if batch <= 1 or "train_batch_size" in config.model_fields_set:
            break
        batch, accumulation = batch // 2, accumulation * 2
    estimate, update = smallest
    raise ConfigError([f"vram_gb {budget:g} is below anything this run fits in: the smallest plan "
                         f"({_describe(update) or 'the settings as given'}) needs about {estimate.peak / GIB:.1f} GiB; "
                         "lower resolution or lora_rank, or leave more knobs to the plan."])


def _describe(update: dict[str, Any]) -> str:
    parts = []
    if update.get("cache_text_embeddings"):
        parts.append("text embeddings cached")
    if update.get("mixed_precision"):
        parts.append(update["mixed_precision"])
    if update.get("gradient_checkpointing"):
        parts.append("gradient checkpointing")
    if update.get("base_storage"):
        parts.append(f"base {update['base_storage']}")
    if update.get("blocks_to_swap"):
        parts.append(f"{update['blocks_to_swap']} blocks swapped")
    if "train_batch_size" in update:
        parts.append(f"micro-batch {update['train_batch_size']} x {update['gradient_accumulation_steps']} accumulated")
    return ", ".join(parts)


def _sentence(budget: float, update: dict[str, Any], estimate_sentence: str) -> str:
    chosen = _describe(update)
    how = f"chose {chosen}" if chosen else "the settings fit as given"
    return f"Memory plan for {budget:g} GiB: {how}. {estimate_sentence}"
