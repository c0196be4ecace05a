"""AUTOMATIC1111 / Forge entry point: adds the StableTune tab (the same UI as `python app.py`).

The WebUI loads every top-level `<extension>/scripts/*.py` at start and on "Reload UI". This file only
makes the extension importable and registers the callbacks; the glue is in extension/webui.py.
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# extension/ is imported under this name: a top-level `extension` package of another extension must
# neither shadow ours nor be shadowed by it.
PACKAGE = "stabletune_extension"

if str(ROOT) not in sys.path:  # for stabletune_core; webui.register() keeps it there after the WebUI
    sys.path.append(str(ROOT))  # restores its sys.path


def _ui_package():
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, ROOT / "extension" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "extension")])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return sys.modules[PACKAGE]


_ui_package()
importlib.import_module(PACKAGE + ".webui").register()
