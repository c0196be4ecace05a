"""Dataset and LoRA tools, each an engine command (`python -m stabletune_core NAME ...`).

One module per tool, each with `add_parser(subparsers)` and `run(args) -> int`. Bad input raises
`ConfigError` with one sentence (the CLI prints it, exit 2) before any model loads. Nothing the user made is
changed unless a flag asks for it, and then the old version is kept. Importing a tool module imports neither
torch nor gradio: the UI reads `caption_edit` in its own process.
"""
