"""Check config values before any GPU time is spent: pydantic rules and the world (folders, disk, images).

In-process when stabletune_core.config imports (pydantic 2: the standalone app, Forge); otherwise the
engine's Python answers (`query_cli validate`), which is what an AUTOMATIC1111 host with pydantic 1 needs.
The dataset scan always runs in the engine's Python (it sits beside torch code): the same check the engine
makes before it loads a model, so Start never spawns a run that dies on a folder without usable images.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from stabletune_core.family_files import (PLANNED_FAMILIES, TRANSFORMER_FAMILIES, file_family, files_name_sdxl,
                                          is_flux2_klein)
from stabletune_core.launch import ask_engine


#: A LoRA trains at about 1e-5 to 1e-3 with every optimizer but prodigy (which wants 1.0); above this a learning
#: rate is a typo or a blow-up waiting to happen (the field accepts up to 1.0, so the check alone lets it pass).
SANE_LEARNING_RATE = 1e-2
LEARNING_RATE_FIELDS = ("learning_rate", "text_encoder_lr")


def warnings(values: dict[str, Any]) -> list[str]:
    """Valid values a user almost surely did not mean, one sentence each, starting with the field's name."""
    if values.get("optimizer") == "prodigy":
        return []  # config.notes() speaks for prodigy's learning rate
    found = []
    for name in LEARNING_RATE_FIELDS:
        rate = values.get(name)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > SANE_LEARNING_RATE:
            found.append(f"{name} {rate:g} is far above what LoRA training uses (about 1e-5 to 1e-3; above "
                         f"{SANE_LEARNING_RATE:g} a run usually blows up into NaN); check the number (only the prodigy "
                         "optimizer wants 1.0).")
    return found


def validate(values: dict[str, Any], engine_python: str) -> tuple[list[str], list[str]]:
    """(problems, notes): problems block the start; notes (valid but doubtful settings: this UI's warnings and
    the engine's notes) are only shown, each beside its field."""
    try:
        from stabletune_core.config import ConfigError, build_config, check_inputs
    except ImportError:
        answer = ask_engine(["validate"], engine_python, stdin=values, timeout=120)
        if "error" in answer:
            return [answer["error"]], []
        problems, notes = list(answer.get("problems", [])), list(answer.get("notes", []))
    else:
        try:
            config = build_config(values)
        except ConfigError as exc:
            return exc.problems + world_problems(values, exc.problems, build_config, check_inputs, ConfigError), []
        problems, notes = check_inputs(config) + detected_family_problems(values, config), config.notes()
        notes += detected_host_limits(values, config)
    problems += [p for p in family_mismatch(values) if p not in problems]
    if not problems:
        problems = dataset_problems(values, engine_python)
    return problems, warnings(values) + notes


def world_problems(values: dict[str, Any], problems: list[str], build_config: Any, check_inputs: Any,
                   error: type) -> list[str]:
    """The folder/model/disk problems too when some values are bad: with the bad fields at their defaults
    the rest is checked, so a missing dataset is named beside a bad learning rate."""
    from .form import field_of

    bad = {field_of(p, values) for p in problems}
    try:
        config = build_config({k: v for k, v in values.items() if k not in bad})
    except error:
        return []
    return [p for p in check_inputs(config) if p not in problems]


def dataset_problems(values: dict[str, Any], engine_python: str) -> list[str]:
    """The engine's sentence when the dataset folder holds no usable image (empty list when it does)."""
    folder = str(values.get("train_data_dir") or "").strip()
    if not folder or not Path(folder).expanduser().is_dir():
        return []  # check_inputs has said so already
    argv = ["scan", "--data", folder, "--caption-extension", values.get("caption_extension") or ".txt",
            "--default-caption", values.get("default_caption") or "", "--no-enable-bucket"]
    answer = ask_engine(argv, engine_python, timeout=900)
    return [answer["error"]] if "error" in answer else []


def is_klein_model(path: str) -> bool:
    """Is this model path a FLUX.2 Klein one: its folder or file says so, or (a hub name) its name does."""
    return names_klein({"pretrained_model_name_or_path": path}) or (
        not Path(path).expanduser().exists() and "klein" in path.lower())


def family_mismatch(values: dict[str, Any]) -> list[str]:
    """model_family names FLUX.2 Klein (or Z-Image) and the local model is another family's, or the other way round:
    the run would fail loading it (issue 37.7), so it is a problem before Start."""
    family = values.get("model_family") or "auto"
    path = str(values.get("pretrained_model_name_or_path") or "").strip()
    if family == "auto" or not path or not Path(path).expanduser().exists():
        return []
    found = transformer_family({"pretrained_model_name_or_path": path})
    named = family if family in TRANSFORMER_FAMILIES else None
    if found == named:
        return []
    what = (f"a {TRANSFORMER_FAMILIES[found].name} model" if found else
            f"not a {TRANSFORMER_FAMILIES[named].name} model")
    return [f"pretrained_model_name_or_path: {Path(path).name} is {what} but model_family is {family}; choose a "
            f"model of that family, or set model_family to auto."]


def names_klein(values: dict[str, Any]) -> bool:
    """The form trains FLUX.2 Klein: the family says so, or (auto) the folder or single file does."""
    return is_flux2_klein(transformer_family(values))


def transformer_family(values: dict[str, Any]) -> str | None:
    """The transformer family (family_files.TRANSFORMER_FAMILIES: FLUX.2 Klein, Z-Image) the form trains: the family
    says so, or (auto) the folder's model_index.json or the single file's tensor names do (family_files.py, the
    engine's own rules, read with the standard library: the host may have neither torch nor safetensors); None for
    the Stable Diffusion families and what cannot be read."""
    family = values.get("model_family") or "auto"
    if family != "auto":
        return family if family in TRANSFORMER_FAMILIES else None
    return file_family(str(values.get("pretrained_model_name_or_path") or ""))


def names_planned_family(values: dict[str, Any]) -> bool:
    """The form trains a family the memory plan covers (family_files.PLANNED_FAMILIES): the family says so, or (auto)
    the model is a Klein, a Z-Image or an SDXL by the engine's file rules (standard library only)."""
    family = values.get("model_family") or "auto"
    if family != "auto":
        return family in PLANNED_FAMILIES
    return (transformer_family(values) in PLANNED_FAMILIES
            or files_name_sdxl(str(values.get("pretrained_model_name_or_path") or "")))


def memory_answer(values: dict[str, Any], engine_python: str) -> dict[str, Any]:
    """The engine's memory answer for the form (query_cli memory: the plan the run would make, the estimate, what each
    choice costs); empty for a family without a memory model (asking costs the engine's start-up, so only those
    ask) and when the engine could not answer."""
    if not names_planned_family(values):
        return {}
    answer = ask_engine(["memory"], engine_python, stdin=values, timeout=120)
    return {} if "error" in answer else answer


def memory_estimate(values: dict[str, Any], engine_python: str) -> str:
    """One sentence shown before Start: the memory plan the run would make, in the words it prints (vram_gb, or on
    a GPU its free memory), else the estimate of the settings as they stand; empty for the other families."""
    answer = memory_answer(values, engine_python)
    return str(answer.get("plan") or answer.get("memory") or "")


def plan_text(answer: dict[str, Any]) -> str:
    """The Model tab's memory line from the engine's answer: the plan's sentence (the engine's console line), or the
    estimate with what having no plan means here, then what each memory choice costs; empty without an answer."""
    said = answer.get("plan") or answer.get("memory")
    if not said:
        return ""
    if not answer.get("plan") and answer.get("gib") is not None:
        said += (" No memory plan on this machine (no GPU to measure): set vram_gb to see the plan for a card; a run "
                 "on a GPU plans for its free memory.")
    return f"🧮 {said}" + (f"\n\n{answer['costs']}" if answer.get("costs") else "")


def detected_host_limits(values: dict[str, Any], config: Any) -> list[str]:
    """With model_family auto and a Klein or Z-Image model, where the run's adapter file will not load
    (config/hosts.py), as config.notes() says for a family that is named."""
    family = transformer_family(values) if (values.get("model_family") or "auto") == "auto" else None
    if family is None:
        return []
    from stabletune_core.config.hosts import run_host_limits

    return run_host_limits(config, family)


def detected_family_problems(values: dict[str, Any], config: Any) -> list[str]:
    """With model_family auto and a Klein or Z-Image model, the knobs that family refuses (config/families.py), as
    the engine would at Start; the schema only judges a family that is named."""
    family = transformer_family(values) if (values.get("model_family") or "auto") == "auto" else None
    if family is None:
        return []
    from stabletune_core.config.families import family_problems

    return family_problems(config, family)
