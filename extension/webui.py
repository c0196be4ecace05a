"""The AUTOMATIC1111 / Forge glue: the StableTune tab, its settings, and what it does to the host.

Everything that imports the WebUI's `modules` lives here, inside functions, so the standalone app never
needs a WebUI. `scripts/stabletune_tab.py` calls `register()` each time the WebUI loads its scripts.

What the tab does to the host, and nothing more: it lists the WebUI's checkpoints in the model picker,
asks the WebUI to unload its checkpoint right before training starts (the trainer is another process and
needs the VRAM), and copies each finished LoRA into the WebUI's Lora folder under a name that is free.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from .settings import REPO_ROOT, UISettings

try:  # Python 3.11+; A1111 runs 3.10, which has tomli through its own requirements
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

TAB_TITLE, TAB_ID = "StableTune", "stabletune"
SECTION = ("stabletune", "StableTune")
OPT_RUNS_DIR = "stabletune_runs_dir"
OPT_TRAINER_PYTHON = "stabletune_trainer_python"
OPT_COPY_LORA = "stabletune_copy_lora"
ENGINE_RECORD = REPO_ROOT / "stabletune-engine.json"  # written by install.py
# In a run started from the tab: where its LoRA goes, and (once done) where it went.
MARKER = "webui-lora.json"
COPY_STATES = ("finished", "stopped")  # a stopped run saves and exports too
WATCH_SECONDS = 5.0

_copy_lock = threading.Lock()  # the watcher thread and the page refresh may both try to copy
_watcher: Optional[threading.Thread] = None
_watched: set = set()  # runs folders the watcher looks at


def log(message: str) -> None:
    print(f"StableTune: {message}", flush=True)


def _ensure_root_on_path() -> None:
    """The WebUI puts the extension folder on sys.path only while a script file runs, then restores the
    old list; the UI imports stabletune_core later (tab build, event handlers), so add it for good."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


def register() -> None:
    from modules import script_callbacks

    _ensure_root_on_path()
    script_callbacks.on_ui_settings(add_settings)
    script_callbacks.on_ui_tabs(ui_tabs)


# ---- settings ----------------------------------------------------------------------------------------------
def settings_category() -> Optional[str]:
    """The settings category the section goes in (A1111 >= 1.7 groups sections; without one it lands in
    "Uncategorized"): A1111's "training", else (Forge has none) a StableTune category of its own."""
    try:
        from modules.options import categories
    except ImportError:  # an older WebUI: no categories at all
        return None
    known = getattr(categories, "mapping", {})
    if "training" in known:
        return "training"
    if SECTION[0] not in known:
        categories.register_category(SECTION[0], SECTION[1])
    return SECTION[0]


def _option(default: Any, label: str, info: str = "") -> Any:
    from modules import shared

    category = settings_category()
    option = shared.OptionInfo(default, label, section=SECTION,
                               **({"category_id": category} if category else {}))
    if info and hasattr(option, "info"):  # A1111 >= 1.3
        option = option.info(info)
    if hasattr(option, "needs_reload_ui"):  # the tab reads these when it is built
        option = option.needs_reload_ui()
    return option


def add_settings() -> None:
    from modules import shared

    shared.opts.add_option(OPT_RUNS_DIR, _option(str(default_runs_dir()), "Folder for StableTune runs",
                                                 "checkpoints, samples and logs of each run"))
    shared.opts.add_option(OPT_TRAINER_PYTHON, _option("", "Python that runs the trainer",
                                                       f"empty: the one install.py chose ({engine_record_python()})"))
    shared.opts.add_option(OPT_COPY_LORA, _option(True, "Copy finished LoRAs into the WebUI's Lora folder",
                                                  "never overwrites: a taken name gets -2, -3 ..."))


def opt(name: str, default: Any) -> Any:
    """A setting's saved value, else `default` (also before on_ui_settings has registered it)."""
    from modules import shared

    data = getattr(shared.opts, "data", {}) or {}
    value = data.get(name, default)
    return default if value is None else value


# ---- the host's folders -------------------------------------------------------------------------------------
def _paths() -> Any:
    try:
        from modules import paths_internal as paths  # light: no torch import
    except ImportError:
        from modules import paths  # type: ignore[no-redef]
    return paths


def _cmd_dirs(*names: str) -> list[Path]:
    """Folders given on the WebUI's command line (A1111: --ckpt-dir, --lora-dir; Forge also lists)."""
    from modules import shared

    found = []
    for name in names:
        value = getattr(shared.cmd_opts, name, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item:
                found.append(Path(item).expanduser())
    return found


def checkpoint_dirs() -> list[Path]:
    folders = [*_cmd_dirs("ckpt_dir", "ckpt_dirs"), Path(_paths().models_path) / "Stable-diffusion"]
    return list(dict.fromkeys(folders))


def lora_dir() -> Path:
    given = _cmd_dirs("lora_dir", "lora_dirs")
    return given[0] if given else Path(_paths().models_path) / "Lora"


def default_runs_dir() -> Path:
    # Inside the WebUI's folder: Gradio 4 (Forge) serves files under its working directory, so samples and
    # LoRA downloads show without extra allowed paths.
    paths = _paths()
    return Path(getattr(paths, "data_path", None) or getattr(paths, "script_path", ".")) / "outputs" / "stabletune"


# ---- the trainer's Python ----------------------------------------------------------------------------------
def engine_record_python() -> Optional[str]:
    try:
        python = json.loads(ENGINE_RECORD.read_text()).get("engine_python")
    except (OSError, ValueError):
        return None
    return python if python and Path(python).exists() else None


def trainer_python() -> str:
    """The setting if given, else what install.py recorded, else the WebUI's own Python (which, in A1111,
    lacks the engine: validation then says what is missing)."""
    chosen = str(opt(OPT_TRAINER_PYTHON, "") or "").strip()
    if chosen:
        return chosen
    recorded = engine_record_python()
    if recorded:
        return recorded
    log(f"install.py has not recorded a trainer Python ({ENGINE_RECORD.name} is missing); using the WebUI's "
        f"own ({sys.executable}). Restart the WebUI to run install.py, or set one in Settings > StableTune.")
    return sys.executable


# ---- hooks the UI calls -----------------------------------------------------------------------------------
def unload_checkpoint() -> str:
    """Ask the WebUI to free the VRAM of its checkpoint; one sentence saying what happened."""
    try:
        from modules import sd_models
    except ImportError as exc:
        return f"Could not reach the WebUI's model loader ({exc}); unload the checkpoint yourself if VRAM is short."
    unload = getattr(sd_models, "unload_model_weights", None)
    if unload is None:
        return "This WebUI has no unload function; if training runs out of memory, unload its checkpoint first."
    try:
        unload()
        try:
            from modules import devices

            devices.torch_gc()
        except Exception:  # only an extra cache flush; the unload itself worked
            pass
    except Exception as exc:  # the WebUI's own failure must not stop the training start
        return f"The WebUI could not unload its checkpoint ({exc}); training may run short of VRAM."
    return ("Unloaded the WebUI's checkpoint to give training the VRAM; it loads again at your next "
            "generation.")


def is_demo_run(run_dir: Path) -> bool:
    """Does the run train the tiny demo model? Its LoRA only fits that model: A1111 reports it as a network
    with errors on any real SD1 checkpoint. (stabletune_core.demo builds it under the cache folder; that
    module needs pydantic 2, which A1111 lacks, so its folder rule is repeated here.)"""
    from stabletune_core.runs.layout import RunPaths  # stdlib only, light enough for the host

    try:
        with open(RunPaths(run_dir).config, "rb") as f:
            model = str(tomllib.load(f).get("pretrained_model_name_or_path") or "")
    except (OSError, ValueError):
        return False
    cache = Path(os.environ.get("STABLETUNE_CACHE", Path.home() / ".cache" / "stabletune")).expanduser().resolve()
    try:
        relative = Path(model).expanduser().resolve().relative_to(cache)
    except ValueError:
        return False
    return relative.parts[0].startswith("demo-")


def run_values(run_dir: Path) -> dict[str, Any]:
    """The run's config.toml as a dict ({} when it cannot be read)."""
    from stabletune_core.runs.layout import RunPaths  # stdlib only, light enough for the host

    try:
        with open(RunPaths(run_dir).config, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return {}


def trained_transformer_family(run_dir: Path) -> Optional[str]:
    """The family a WebUI cannot run (FLUX.2 Klein, Z-Image) that the run trains, named or detected; None else."""
    from .validation import transformer_family

    return transformer_family(run_values(run_dir))


def host_note(run_dir: Path, family: str) -> str:
    """Where a FLUX.2 Klein or Z-Image LoRA loads: AUTOMATIC1111 cannot run either, and Forge could not when this
    was written, so the file is not copied into the WebUI's Lora folder, where it would be listed and then fail."""
    from stabletune_core.family_files import TRANSFORMER_FAMILIES
    from stabletune_core.runs.layout import RunPaths

    words, short, pipeline = TRANSFORMER_FAMILIES[family]
    name = run_values(run_dir).get("output_name") or "NAME"
    return (f"{words} trains here in its own engine process, but AUTOMATIC1111 and Forge cannot load {short} "
            f"LoRAs: load {RunPaths(run_dir).output / f'{name}.safetensors'} in ComfyUI (models/loras) or in "
            f"diffusers ({pipeline}.load_lora_weights); it is not copied into the WebUI's Lora folder.")


def before_start(run_dir: Path, copy_to: Optional[Path]) -> str:
    if is_demo_run(run_dir):
        return ("Demo run on the tiny demo model: its LoRA stays in the run folder and is not copied into the "
                "WebUI's Lora folder (it only works with the demo model).")
    if family := trained_transformer_family(run_dir):
        return f"{unload_checkpoint()} {host_note(run_dir, family)}"
    if copy_to is not None:
        _write_json(Path(run_dir) / MARKER, {"copy_to": str(copy_to), "copied": {}})
    return unload_checkpoint()


def run_note(run_dir: Path) -> Optional[str]:
    """The status line's note of a run: where its LoRA was copied, or, for FLUX.2 Klein and Z-Image, where it
    loads."""
    copied = copy_finished_lora(run_dir)
    family = trained_transformer_family(run_dir) if copied is None and not (Path(run_dir) / MARKER).exists() else None
    if family:
        return host_note(run_dir, family)
    return copied


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def copy_new_name(source: Path, folder: Path) -> Path:
    """Copy `source` into `folder` as NAME.safetensors, or NAME-2, NAME-3 ... when taken: never overwrites.

    The copy is made under a hidden name and linked into place (linking fails if the name exists), so the
    WebUI never lists a half-written file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{source.name}.stabletune-{os.getpid()}.tmp"
    shutil.copyfile(source, tmp)
    try:
        n = 1
        while True:
            target = folder / (source.name if n == 1 else f"{source.stem}-{n}{source.suffix}")
            try:
                os.link(tmp, target)
                return target
            except FileExistsError:
                n += 1
            except OSError:  # a filesystem without hard links: exclusive create, then copy
                try:
                    with open(target, "xb") as out, open(tmp, "rb") as src:
                        shutil.copyfileobj(src, out)
                    return target
                except FileExistsError:
                    n += 1
    finally:
        tmp.unlink(missing_ok=True)


def copy_finished_lora(run_dir: Path) -> Optional[str]:
    """For a run started from the tab that has finished (or was stopped): copy its LoRA files into the
    WebUI's Lora folder, once. A note for the status line, or None when there is nothing to say."""
    from stabletune_core.runs.layout import RunPaths  # stdlib only, light enough for the host

    run_dir = Path(run_dir)
    marker = run_dir / MARKER
    with _copy_lock:
        try:
            data = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if not data.get("copied"):
            try:
                state = json.loads(RunPaths(run_dir).status.read_text()).get("state")
            except (OSError, ValueError):
                return None
            files = sorted(RunPaths(run_dir).output.glob("*.safetensors"))
            if state not in COPY_STATES or not files:
                return None
            folder = Path(data["copy_to"])
            data["copied"] = {f.name: str(copy_new_name(f, folder)) for f in files}
            _write_json(marker, data)
            for source, target in data["copied"].items():
                log(f"copied {RunPaths(run_dir).output / source} to {target}")
    names = ", ".join(f"`{Path(t).name}`" for t in data["copied"].values())
    first = Path(next(iter(data["copied"].values()))).stem
    return (f"LoRA copied to the WebUI's Lora folder ({data['copy_to']}): {names}. Refresh the Lora list in "
            f"txt2img and use it as `<lora:{first}:1>`.")


def _watch() -> None:
    """Copy finished LoRAs even when no browser has the tab open."""
    while True:
        for runs_dir in list(_watched):
            try:
                for marker in runs_dir.glob(f"*/{MARKER}"):
                    copy_finished_lora(marker.parent)
            except Exception as exc:  # never let the watcher die of one odd run folder
                log(f"LoRA copy check failed: {exc}")
        time.sleep(WATCH_SECONDS)


def start_watcher(runs_dir: Path) -> None:
    """One daemon thread per WebUI process; a changed runs folder (after Reload UI) is watched too."""
    global _watcher
    _watched.add(Path(runs_dir))
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch, name="stabletune-lora-copy", daemon=True)
        _watcher.start()


# ---- the tab -------------------------------------------------------------------------------------------------
def webui_settings() -> UISettings:
    copy_to = lora_dir() if opt(OPT_COPY_LORA, True) else None
    return UISettings(runs_dir=Path(str(opt(OPT_RUNS_DIR, "") or default_runs_dir())),
                      engine_python=trainer_python(), model_dirs=checkpoint_dirs(),
                      before_start=lambda run_dir: before_start(run_dir, copy_to), run_note=run_note)


def ui_tabs() -> list[tuple[Any, str, str]]:
    _ensure_root_on_path()
    from .ui import build_ui

    settings = webui_settings()
    blocks = build_ui(settings)
    start_watcher(settings.runs_dir)
    log(f"tab ready; runs in {settings.runs_dir}, trainer Python {settings.engine_python}")
    return [(blocks, TAB_TITLE, TAB_ID)]
