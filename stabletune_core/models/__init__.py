"""Model families behind one face. Ask the registry, never ``if sdxl:``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .base import Conditioning, ModelBundle, ModelFamily, ModelLoadError

#: name -> factory. Other families (sd2, sdxl) register themselves here.
FAMILIES: dict[str, Callable[[], ModelFamily]] = {}


def register_family(name: str, factory: Callable[[], ModelFamily]) -> None:
    FAMILIES[name] = factory


def _sd1():
    from .sd.sd1 import SD1

    return SD1()


def _sd2():
    from .sd.sd2 import SD2

    return SD2()


def _sdxl():
    from .sd.sdxl import SDXL

    return SDXL()


def _flux2_klein():
    from .flux2_klein.family import Flux2Klein

    return Flux2Klein()


def _z_image():
    from .z_image.family import ZImage

    return ZImage()


register_family("sd1", _sd1)
register_family("sd2", _sd2)
register_family("sdxl", _sdxl)
register_family("flux2_klein", _flux2_klein)
register_family("z_image", _z_image)


def get_family(name: str) -> ModelFamily:
    """A fresh family object for "sd1", "sd2", "sdxl", "flux2_klein" or "z_image"."""
    key = (name or "").strip().lower()
    if key not in FAMILIES:
        raise ValueError(f"Unknown model family '{name}'; known families are: {', '.join(sorted(FAMILIES))}.")
    return FAMILIES[key]()




def detect_family(source: str | Path) -> str:
    """Best-effort guess of the family from configs or checkpoint keys; "sd1" when unsure."""
    path = Path(str(source)).expanduser()
    from .flux2_klein.family import looks_like_klein

    from .z_image.family import looks_like_z_image

    if looks_like_klein(path):
        return "flux2_klein"
    if looks_like_z_image(path):
        return "z_image"
    try:
        if path.is_dir():
            index = path / "model_index.json"
            if index.is_file():
                data = json.loads(index.read_text())
                if "text_encoder_2" in data or "XL" in str(data.get("_class_name", "")):
                    return "sdxl"
            unet_cfg = path / "unet" / "config.json"
            if unet_cfg.is_file():
                cfg = json.loads(unet_cfg.read_text())
                if cfg.get("addition_embed_type") == "text_time":
                    return "sdxl"
                if cfg.get("cross_attention_dim") == 1024:
                    return "sd2"
            te_cfg = path / "text_encoder" / "config.json"
            if te_cfg.is_file() and json.loads(te_cfg.read_text()).get("hidden_act") == "gelu":
                return "sd2"  # OpenCLIP's gelu; SD1's CLIP uses quick_gelu (this also tells tiny test models apart)
            return "sd1"
        if path.is_file() and path.suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
            if any(k.startswith("conditioner.embedders.1.") for k in keys):
                return "sdxl"
            if any(k.startswith("cond_stage_model.model.") for k in keys):
                return "sd2"
    except (OSError, ValueError):
        pass
    return "sd1"


__all__ = [
    "Conditioning",
    "ModelBundle",
    "ModelFamily",
    "ModelLoadError",
    "FAMILIES",
    "register_family",
    "get_family",
    "detect_family",
]
