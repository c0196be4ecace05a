"""A1111 1.10's "Reload UI" on a page with the StableTune tab: launch the WebUI-like page with the queue,
wait while a browser has it open, then `demo.close()` (what webui.py does on a restart) and launch again.

    PYTHONPATH=tests/fake_webui FAKE_WEBUI_ROOT=... python reload_ui.py EXT_DIR PORT GO_FILE

Prints "ready" once serving, waits for GO_FILE to exist (the test has the page open and refreshing by
then), and prints one JSON line: how long close() took (null when it hung) and whether the relaunch served.
"""
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import gradio as gr

from load_tab import load_scripts
from modules import script_callbacks


def page() -> gr.Blocks:
    """modules/ui.py: every extension tab rendered into the WebUI's own Blocks."""
    tabs = script_callbacks.ui_tabs_callback()
    with gr.Blocks(analytics_enabled=False) as demo:
        with gr.Tabs(elem_id="tabs"):
            for interface, label, ifid in tabs:
                with gr.TabItem(label, id=ifid, elem_id=f"tab_{ifid}"):
                    interface.render()
    return demo


def serve(demo: gr.Blocks, port: int) -> None:
    demo.queue(64)  # webui.py: shared.demo.queue(64)
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)


def main() -> None:
    ext, port, go = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    load_scripts(ext)
    script_callbacks.ui_settings_callback()
    demo = page()
    serve(demo, port)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.2)
    started = time.time()
    closer = threading.Thread(target=demo.close, daemon=True)  # webui.py: shared.demo.close()
    closer.start()
    closer.join(60)
    close_s = None if closer.is_alive() else round(time.time() - started, 2)
    relaunched = False
    if close_s is not None:
        time.sleep(0.5)
        script_callbacks.clear_callbacks()
        load_scripts(ext)  # Reload UI runs the extension scripts again
        serve(page(), port)
        try:
            relaunched = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).status == 200
        except OSError:
            relaunched = False
    print(json.dumps({"close_s": close_s, "relaunched": relaunched}), flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)  # a hung server thread must not keep the test waiting


if __name__ == "__main__":
    main()
