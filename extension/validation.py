"""Check config values before any GPU time is spent: pydantic rules and the world (folders, disk, images).

In-process when stabletune_core.config imports (pydantic 2: the standalone app, Forge); otherwise the
engine's Python answers (`query_cli validate`), which is what an AUTOMATIC1111 host with pydantic 1 needs.
The dataset scan always runs in the engine's Python (it sits beside torch code): the same check the engine
makes before it loads a model, so Start never spawns a run that dies on a folder without usable images.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    """model_family names FLUX.2 Klein and the local model is a Stable Diffusion one, or the other way round: the
    run would fail loading it (issue 37.7), so it is a problem before Start."""
    family = values.get("model_family") or "auto"
    path = str(values.get("pretrained_model_name_or_path") or "").strip()
    if family == "auto" or not path or not Path(path).expanduser().exists():
        return []
    klein = names_klein({"pretrained_model_name_or_path": path})
    if klein == (family == "flux2_klein"):
        return []
    what = "a FLUX.2 Klein model" if klein else "not a FLUX.2 Klein model"
    return [f"pretrained_model_name_or_path: {Path(path).name} is {what} but model_family is {family}; choose a "
            f"model of that family, or set model_family to auto."]


def names_klein(values: dict[str, Any]) -> bool:
    """The form trains FLUX.2 Klein: the family says so, or (auto) the folder's model_index.json or the single
    file's tensor names do (read with the standard library: the host may have neither torch nor safetensors)."""
    family = values.get("model_family") or "auto"
    if family != "auto":
        return family == "flux2_klein"
    path = Path(str(values.get("pretrained_model_name_or_path") or "")).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".safetensors":
            bare = {k.removeprefix("model.diffusion_model.") for k in _safetensors_keys(path)}
            # the engine's rule (models/flux2_klein.py checkpoint_kind): FLUX.2 modulation, no guidance input
            return "double_stream_modulation_img.lin.weight" in bare and "guidance_in.in_layer.weight" not in bare
        return str(json.loads((path / "model_index.json").read_text()).get("_class_name", "")).startswith(
            "Flux2Klein")
    except (OSError, ValueError, AttributeError):
        return False


#: A safetensors header larger than this is not a model's (the real 9B's is well under 1 MB).
MAX_HEADER_BYTES = 100 * 2 ** 20


def _safetensors_keys(path: Path) -> set[str]:
    """The tensor names of a .safetensors file: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{path.name} has no safetensors header")
        header = json.loads(f.read(size))
    return {k for k in header if k != "__metadata__"}


#: The families the engine's memory plan covers (stabletune_core/models/memory_plan.py FAMILY_MEMORY_MODELS).
PLANNED_FAMILIES = ("flux2_klein", "sdxl")


def names_planned_family(values: dict[str, Any]) -> bool:
    """The form trains a family the memory plan covers: the family says so, or (auto) the model is a Klein or an SDXL
    (its model_index.json, or a single file's SDXL-only second text encoder keys; standard library only)."""
    family = values.get("model_family") or "auto"
    if family != "auto":
        return family in PLANNED_FAMILIES
    if names_klein(values):
        return True
    path = Path(str(values.get("pretrained_model_name_or_path") or "")).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".safetensors":
            return any(k.startswith("conditioner.embedders.1.") for k in _safetensors_keys(path))
        return str(json.loads((path / "model_index.json").read_text()).get("_class_name", "")).startswith(
            "StableDiffusionXL")
    except (OSError, ValueError, AttributeError):
        return False


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
    """With model_family auto and a Klein folder, where the run's adapter file will not load (config/hosts.py), as
    config.notes() says for a Klein that is named."""
    if (values.get("model_family") or "auto") != "auto" or not names_klein(values):
        return []
    from stabletune_core.config.hosts import run_host_limits

    return run_host_limits(config, "flux2_klein")


def detected_family_problems(values: dict[str, Any], config: Any) -> list[str]:
    """With model_family auto and a Klein folder, the knobs Klein refuses (config/families.py), as the engine
    would at Start; the schema only judges a family that is named."""
    if (values.get("model_family") or "auto") != "auto" or not names_klein(values):
        return []
    from stabletune_core.config.families import family_problems

    return family_problems(config, "flux2_klein")
