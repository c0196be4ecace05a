"""The tiny FLUX.2 Klein the test_flux2_* files share: built once per test session (a few seconds), offline."""
from __future__ import annotations

from pathlib import Path

import pytest

_BUILT: dict[str, dict[str, Path]] = {}


def tiny_klein_paths(factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"folder": diffusers folder, "distilled_folder", "config": config tree, "transformer"/"text_encoder"/"vae"/
    "tokenizer": the single files of a ComfyUI layout (base model), "comfy": that ComfyUI root}."""
    if "paths" not in _BUILT:
        from stabletune_core.models.flux2_klein.tiny import (build_tiny_klein, build_tiny_klein_single_files,
                                                       write_tiny_config_tree)

        root = factory.mktemp("tiny-klein")
        paths = {"folder": build_tiny_klein(root / "folder", seed=0),
                 "distilled_folder": build_tiny_klein(root / "distilled", seed=0, distilled=True),
                 "config": write_tiny_config_tree(root / "config", seed=0), "comfy": root / "ComfyUI"}
        paths.update(build_tiny_klein_single_files(paths["comfy"], seed=0))
        _BUILT["paths"] = paths
    return _BUILT["paths"]


def one_sentence(message: str) -> bool:
    """What the house rules ask of an error: one line, one sentence, no traceback."""
    text = message.strip()
    return "\n" not in text and "Traceback" not in text and text.endswith(".") and text.count(". ") <= 1
