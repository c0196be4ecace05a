"""The memory plan (``vram_gb``, or without it on a CUDA card the free memory measured): the cheapest settings with
which a run fits a card of that size, by its family's memory model (flux2_klein/memory.py, sd/sdxl_memory.py,
z_image/memory.py, each built of models/memory.py's shared parts), chosen before any model loads. A CPU run has no
plan; SD 1.x and 2.x have no memory model.

Cheapest means least cost to speed and quality first. The ladder, each rung keeping the ones before it:

1. the settings as given;
2. text embeddings cached (Qwen3 runs once before training and leaves the GPU; nothing about training changes);
   then mixed_precision bf16 when the run would otherwise keep the frozen model in fp32 (Klein's own precision);
3. gradient checkpointing (about 20-30 % slower, the same numbers);
4. base_storage int8 (the frozen weights in 8 bits, close to bf16 in quality);
5. int8 with 1, 2, ... blocks swapped (copies overlap the compute; the more blocks, the more PCIe traffic; Klein
   and Z-Image: SDXL's UNet has no block swap, see sdxl_memory.py);
6. base_storage nf4 with 0, 1, ... blocks swapped (4 bits: the larger quality cost);
7. then the micro-batch is halved (gradient accumulation doubled, so the effective batch stays) and the ladder
   climbed again.

A knob the user set (present in the config as given: a flag, a TOML key) is never changed; a rung that would change
it is skipped. When nothing fits, one sentence names the smallest plan and what it needs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .memory import GIB, FamilyMemoryModel, MemoryEstimate


def _klein() -> FamilyMemoryModel:
    from .flux2_klein.memory import MEMORY_MODEL

    return MEMORY_MODEL


def _sdxl() -> FamilyMemoryModel:
    from .sd.sdxl_memory import MEMORY_MODEL

    return MEMORY_MODEL


def _z_image() -> FamilyMemoryModel:
    from .z_image.memory import MEMORY_MODEL

    return MEMORY_MODEL


#: family -> its folder's memory model, imported when first asked (as models/__init__.py's FAMILIES). The families a
#: plan covers: family_files.PLANNED_FAMILIES names the same ones for the UI and the knob checks, which cannot import
#: models/ (a test keeps them equal, and each family's own `plans_memory`).
FAMILY_MEMORY_MODELS: dict[str, Callable[[], FamilyMemoryModel]] = {
    "flux2_klein": _klein, "sdxl": _sdxl, "z_image": _z_image}


def memory_sentence(config: Any, family: str) -> tuple[str, MemoryEstimate]:
    """The estimate sentence and estimate of a TrainConfig's run of `family` (one in FAMILY_MEMORY_MODELS)."""
    return FAMILY_MEMORY_MODELS[family]().sentence(config)


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


#: What a plan for the measured card leaves free. The estimate's 0.8 GiB CUDA context is partly spent already (the
#: context torch.cuda.mem_get_info creates is out of the free bytes it reports), so that allowance doubles as a
#: cushion for cuBLAS / cuDNN workspaces made later; the margin is for what else may grow on the card during the
#: run (a display server, a browser tab on a desktop card: a few hundred MiB).
MEASURED_MARGIN_BYTES = GIB // 2


def measured_budget(free_bytes: int | None) -> float | None:
    """The GiB to plan for on a card with `free_bytes` free (torch.cuda.mem_get_info): those less the margin. None
    when there is no card to measure (a CPU run: no plan, nothing said)."""
    if free_bytes is None:
        return None
    return max(free_bytes - MEASURED_MARGIN_BYTES, 0) / GIB


def free_device_bytes() -> int | None:
    """Free bytes on this process's CUDA device (LOCAL_RANK's under a multi-GPU launcher), None without one."""
    import os

    import torch

    return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))[0] if torch.cuda.is_available() else None


def plan_memory(config: Any, measured_gib: float | None = None, family: str = "flux2_klein") -> MemoryPlan:
    """The plan for `config.vram_gb` GiB, or without it for `measured_gib` (the card's free memory less the margin:
    measured_budget), of a TrainConfig of a run of `family` (one in FAMILY_MEMORY_MODELS); one sentence when no plan fits
    (ConfigError)."""
    budget = float(config.vram_gb or measured_gib)
    measured = not config.vram_gb
    model = FAMILY_MEMORY_MODELS[family]()
    estimate_sentence, blocks = model.sentence, model.swappable_blocks(config)
    smallest: tuple[MemoryEstimate, dict[str, Any], str] | None = None
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
            sentence, estimate = estimate_sentence(planned)
            if smallest is None or estimate.peak < smallest[0].peak:
                smallest = (estimate, update, sentence)
            if estimate.fits(budget):
                return MemoryPlan(update, estimate, _sentence(budget, update, sentence, measured))
        if batch <= 1 or "train_batch_size" in config.model_fields_set:
            break
        batch, accumulation = batch // 2, accumulation * 2
    estimate, update, sentence = smallest
    if measured:  # a model, not a measurement: the run the user asked for is tried, never refused on an estimate
        return MemoryPlan(update, estimate, _sentence(budget, update, sentence, measured, fits=False))
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


def _sentence(budget: float, update: dict[str, Any], estimate_sentence: str, measured: bool, *,
              fits: bool = True) -> str:
    chosen = _describe(update)
    how = f"chose {chosen}" if chosen else "the settings fit as given"
    if not fits:
        how = ("nothing fits by the estimate, so the smallest plan is tried (the out-of-memory guard backs off if a "
               f"step does not fit): {chosen or 'the settings as given'}")
    card = f"{budget:.1f} GiB (the GPU's free memory less a 0.5 GiB margin; --vram_gb plans for another)" \
        if measured else f"{budget:g} GiB"
    return f"Memory plan for {card}: {how}. {estimate_sentence}"


#: The choices the UI's Model tab prices (the knob, the values it shows): a base_storage a card may lack (fp8) is
#: priced anyway, the run refuses it there in one sentence.
PRICED_CHOICES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("base_storage", ("full", "int8", "nf4", "fp8")), ("gradient_checkpointing", (True, False)),
    ("cache_text_embeddings", (True, False)))


def choice_costs(config: Any, family: str) -> str:
    """One line of what each memory choice needs at the peak, the other settings as `config` has them (the planned
    config, for the UI: what the run would use): each base_storage, each few blocks swapped (Klein, Z-Image), gradient
    checkpointing and the text cache on and off; the current value of each marked."""
    model = FAMILY_MEMORY_MODELS[family]()
    estimate_sentence, blocks = model.sentence, model.swappable_blocks(config)
    choices = [*PRICED_CHOICES, *((("blocks_to_swap", tuple(range(0, blocks + 1, max(blocks // 4, 1)))),)
                                  if blocks else ())]
    parts = []
    for knob, values in choices:
        prices = []
        for value in values:
            peak = estimate_sentence(config.model_copy(update={knob: value}))[1].peak / GIB
            mark = " (now)" if getattr(config, knob) == value else ""
            prices.append(f"{({True: 'on', False: 'off'}[value] if isinstance(value, bool) else value)}{mark} "
                          f"{peak:.1f}")
        parts.append(f"{knob} " + " · ".join(prices))
    return "What each choice needs (GiB at the peak, the rest as above): " + "; ".join(parts) + "."
