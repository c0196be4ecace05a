"""StableTune's Gradio UI: the standalone app (app.py) and the AUTOMATIC1111/Forge tab (webui.py).

Never imports torch: the engine runs as its own process and the UI reads its run directory.
"""
