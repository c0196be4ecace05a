"""Load an extension's scripts the way AUTOMATIC1111 1.10 does, build its tab inside a WebUI-like page,
exercise the host hooks, and print one JSON report. Run with the fake WebUI on PYTHONPATH:

    PYTHONPATH=tests/fake_webui FAKE_WEBUI_ROOT=... python load_tab.py EXT_DIR [--train VALUES_JSON]

--train starts a real run from the tab's Train code path (with the values given) and waits until the
watcher has copied its LoRA into models/Lora; with --no-copy (a FLUX.2 Klein run, whose LoRA this WebUI cannot
load) until the run has ended and the watcher has had a round to (wrongly) copy it. Without --train, a finished
run is laid out by hand instead.
"""
import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import gradio as gr

from modules import script_callbacks, shared
from modules.paths_internal import models_path


def load_scripts(ext: Path) -> None:
    """modules/scripts.py: the extension folder is on sys.path only while each script executes."""
    for script in sorted((ext / "scripts").glob("*.py")):
        saved = sys.path
        try:
            sys.path = [str(ext)] + sys.path
            spec = importlib.util.spec_from_file_location(script.name, script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path = saved


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ext", type=Path)
    parser.add_argument("--train", help="JSON values of a run to start from the Train tab")
    parser.add_argument("--no-copy", action="store_true", help="the run's LoRA is not for this WebUI: wait for the "
                        "run to end instead of for the copy")
    args = parser.parse_args()
    report = {"gradio": gr.__version__}

    load_scripts(args.ext)
    report["root_on_path_after_load"] = str(args.ext) in sys.path
    script_callbacks.ui_settings_callback()
    report["settings"] = {k: {"default": v.default, "section": list(v.section), "reload": v.reload_ui,
                              "category": v.category_id}
                          for k, v in shared.opts.data_labels.items()}
    tabs = script_callbacks.ui_tabs_callback()
    report["tabs"] = [[type(b).__name__, isinstance(b, gr.Blocks), title, elem_id] for b, title, elem_id in tabs]
    blocks = tabs[0][0]
    # modules/ui.py: every tab is rendered into the WebUI's own page.
    with gr.Blocks(analytics_enabled=False) as demo:
        with gr.Tabs(elem_id="tabs"):
            for interface, label, ifid in tabs:
                with gr.TabItem(label, id=ifid, elem_id=f"tab_{ifid}"):
                    interface.render()
    report["page_components"] = len(demo.get_config_file()["components"])

    ctx = blocks.stabletune_context
    settings = ctx.settings
    report.update(engine_python=settings.engine_python, runs_dir=str(settings.runs_dir),
                  model_dirs=[str(p) for p in settings.model_dirs],
                  model_choices=str(ctx.parts["model.found"].choices),
                  ui_package=type(ctx).__module__, torch_imported="torch" in sys.modules)

    lora_dir = Path(models_path) / "Lora"
    if args.train:
        # The package name scripts/stabletune_tab.py gives extension/.
        train = importlib.import_module("stabletune_extension.tabs.train")
        values = json.loads(args.train)
        report["start_message"], _ = train._launch(ctx, values)  # (message, run folder)
        run = ctx.hub.attached
        name = values["output_name"]
        if args.no_copy:
            report["run_ended"] = wait_for(lambda: ctx.hub.status(run).get("state") in ("finished", "stopped",
                                                                                       "failed"), 400)
            time.sleep(7)  # one more round of the watcher (every 5 s): it must not copy this LoRA
            report["copied_by_watcher"] = sorted(p.name for p in lora_dir.glob(f"{name}*"))
        else:
            report["copied_by_watcher"] = wait_for(lambda: (lora_dir / f"{name}-2.safetensors").exists(), 240)
        report["run_state"] = ctx.hub.status(run).get("state")
    else:
        run = settings.runs_dir / "handmade"
        report["start_message"] = settings.before_start(run)
        (run / "output").mkdir(parents=True)
        (run / "output" / "handmade.safetensors").write_bytes(b"new lora")
        report["note_before_finish"] = settings.run_note(run)
        (run / "status.json").write_text(json.dumps({"state": "finished"}))
    report["status_note"] = settings.run_note(run)
    report["status_note_again"] = settings.run_note(run)  # copying happens once
    train_tab = importlib.import_module("stabletune_extension.tabs.train")
    ctx.hub.attach(run)
    report["train_status_line"] = train_tab.refresh(ctx, {})[0]
    report["lora_files"] = {p.name: p.read_bytes()[:16].decode("latin-1") for p in sorted(lora_dir.iterdir())}
    report["run_dir"] = str(run)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
