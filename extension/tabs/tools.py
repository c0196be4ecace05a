"""LoRA tools tab: merge LoRAs into a checkpoint, merge several LoRAs into one, extract a LoRA from a fine-tune.
Each runs `python -m stabletune_core merge|extract` in the engine's Python with a progress line; the UI process
never loads a model."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import dataset_view
from ..compat import listen, make
from ..context import UIContext

TITLE = "LoRA tools"


def build(ctx: UIContext) -> None:
    p = ctx.parts
    gr.Markdown("Every tool writes a new file (or folder) and never changes its inputs. LoRAs take a weight after "
                "a colon: `style.safetensors:0.7`, one per line.")
    with make(gr.Accordion, label="Merge LoRAs into a checkpoint", open=True, elem_id="tools-merge"):
        with gr.Row():
            p["tools.merge_model"] = make(gr.Textbox, label="Checkpoint (.safetensors file or diffusers folder)",
                                          elem_id="tools-merge-model")
            p["tools.merge_output"] = make(gr.Textbox, label="New checkpoint (.safetensors: single file for the "
                                           "WebUIs; other names: a diffusers folder)", elem_id="tools-merge-output")
        p["tools.merge_loras"] = make(gr.Textbox, label="LoRA files and weights", lines=3,
                                      elem_id="tools-merge-loras")
        p["tools.merge_precision"] = make(gr.Radio, label="Precision", choices=["same", "fp16", "bf16", "fp32"],
                                          value="same")
        p["tools.merge_go"] = make(gr.Button, value="Merge into checkpoint", variant="primary",
                                   elem_id="tools-merge-go")
    with make(gr.Accordion, label="Merge several LoRAs into one", open=False, elem_id="tools-combine"):
        p["tools.combine_loras"] = make(gr.Textbox, label="LoRA files and weights", lines=3,
                                        elem_id="tools-combine-loras")
        with gr.Row():
            p["tools.combine_rank"] = make(gr.Number, label="Rank of the result", value=16, precision=0)
            p["tools.combine_output"] = make(gr.Textbox, label="New LoRA (.safetensors)",
                                             elem_id="tools-combine-output")
        p["tools.combine_go"] = make(gr.Button, value="Merge LoRAs", elem_id="tools-combine-go")
    with make(gr.Accordion, label="Extract a LoRA from a fine-tuned checkpoint", open=False, elem_id="tools-extract"):
        with gr.Row():
            p["tools.extract_base"] = make(gr.Textbox, label="Base checkpoint", elem_id="tools-extract-base")
            p["tools.extract_tuned"] = make(gr.Textbox, label="Fine-tuned checkpoint", elem_id="tools-extract-tuned")
        with gr.Row():
            p["tools.extract_rank"] = make(gr.Number, label="Rank (the ceiling when energy is set)", value=32,
                                           precision=0)
            p["tools.extract_energy"] = make(gr.Number, label="Energy kept per module (0 = off, e.g. 0.95)", value=0)
            p["tools.extract_output"] = make(gr.Textbox, label="New LoRA (.safetensors)",
                                             elem_id="tools-extract-output")
        p["tools.extract_go"] = make(gr.Button, value="Extract LoRA", elem_id="tools-extract-go")
    p["tools.status"] = make(gr.Markdown, value="", elem_id="tools-status")


def lora_args(text: str) -> list[str]:
    return [line.strip() for line in (text or "").replace(",", "\n").splitlines() if line.strip()]


def merge_args(model: str, loras: str, output: str, precision: str) -> list[str]:
    return ["--model", (model or "").strip(), "--lora", *lora_args(loras), "--output", (output or "").strip(),
            "--save_precision", precision or "same"]


def combine_args(loras: str, rank: Any, output: str) -> list[str]:
    return ["--lora", *lora_args(loras), "--rank", str(int(rank or 16)), "--output", (output or "").strip()]


def extract_args(base: str, tuned: str, rank: Any, energy: Any, output: str) -> list[str]:
    args = ["--base", (base or "").strip(), "--tuned", (tuned or "").strip(), "--rank", str(int(rank or 32)),
            "--output", (output or "").strip()]
    return args + (["--energy", str(float(energy))] if energy else [])


def _run(ctx: UIContext, command: str, args: list[str]):
    if any(not a for a in args) or (command == "merge" and args[args.index("--lora") + 1] == "--output"):
        yield "⚠ Fill in every field (at least one LoRA)."
        return
    yield f"Running `{command}`..."
    for line, result in dataset_view.run_tool(dataset_view.tool_command(ctx.settings.engine_python, command, *args)):
        yield f"`{line}`" if result is None else result.strip().splitlines()[-1]


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    listen(p["tools.merge_go"].click, lambda *a: (yield from _run(ctx, "merge", merge_args(*a))),
           [p["tools.merge_model"], p["tools.merge_loras"], p["tools.merge_output"], p["tools.merge_precision"]],
           [p["tools.status"]])
    listen(p["tools.combine_go"].click, lambda *a: (yield from _run(ctx, "merge", combine_args(*a))),
           [p["tools.combine_loras"], p["tools.combine_rank"], p["tools.combine_output"]], [p["tools.status"]])
    listen(p["tools.extract_go"].click, lambda *a: (yield from _run(ctx, "extract", extract_args(*a))),
           [p["tools.extract_base"], p["tools.extract_tuned"], p["tools.extract_rank"], p["tools.extract_energy"],
            p["tools.extract_output"]], [p["tools.status"]])
