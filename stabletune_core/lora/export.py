"""Write trained LoRA adapters in the formats people actually load.

* kohya / A1111 format (``export_kohya_lora``): one ``.safetensors`` with
  ``lora_unet_*`` / ``lora_te_*`` ``lora_down`` / ``lora_up`` / ``alpha`` tensors
  and sd-scripts' ``ss_*`` + ``modelspec.*`` metadata. Loads in A1111, Forge,
  ComfyUI and diffusers' ``load_lora_weights``. A DoRA layer adds its ``dora_scale``
  (lora/dora.py), which A1111 1.9+, Forge and ComfyUI apply.
* diffusers / PEFT format (``export_diffusers_lora``): what
  ``train_text_to_image_lora.py`` writes (``pytorch_lora_weights.safetensors``),
  with the LoRA config stored so alpha != rank survives the round trip.

Inputs are models with PEFT LoRA layers injected (``unet.add_adapter(LoraConfig)``
or ``peft.inject_adapter_in_model``), exactly as the training loop holds them.
Dropout plays no part (it only acts in the forward pass during training).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..atomic import atomic_path, user_permissions  # noqa: F401  (user_permissions: old home)
from .dora import dora_scale
from .layers import LoraLayerView, iter_lora_layers, unwrap
from .names import DORA_SCALE, kohya_keys, kohya_te_name

#: Metadata keys every kohya export carries (filled with defaults when the caller has none).
REQUIRED_METADATA_KEYS = (
    "ss_network_module",
    "ss_network_dim",
    "ss_network_alpha",
    "ss_v2",
    "ss_base_model_version",
    "ss_output_name",
    "ss_sd_model_name",
    "ss_resolution",
    "ss_tag_frequency",
    "ss_training_started_at",
    "ss_training_finished_at",
    "modelspec.sai_model_spec",
    "modelspec.architecture",
    "modelspec.implementation",
    "modelspec.title",
    "modelspec.date",
    "modelspec.resolution",
    "sshs_model_hash",
    "sshs_legacy_hash",
)


class LoraExportError(Exception):
    """The adapter cannot be written as asked; the message is one sentence."""


# --------------------------------------------------------------------------- PEFT walk
def exportable_layers(model, adapter_name: str = "default") -> Iterator[LoraLayerView]:
    """The LoRA layers of `model`, refusing (one sentence) what the kohya/A1111 format cannot express."""
    for layer in iter_lora_layers(model, adapter_name):
        if layer.magnitude is not None and not layer.dora_on_input:
            raise LoraExportError(f"'{layer.path}' is a peft DoRA layer (magnitude per output channel), which A1111 "
                                  "and ComfyUI cannot apply; train DoRA with StableTune's use_dora (per input "
                                  "channel) instead.")
        if getattr(layer.up_module, "bias", None) is not None:
            raise LoraExportError(f"'{layer.path}' has a LoRA bias (lora_bias=True), which the kohya/A1111 format "
                                  "cannot express.")
        yield layer


def iter_lora_modules(model, adapter_name: str = "default") -> Iterable[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """Yield (module path, lora_down [r, in, ...], lora_up [out, r, ...], kohya alpha) for every LoRA layer.

    The alpha is the one that reproduces PEFT's scaling under kohya's rule ``scale = alpha / rank``
    (rsLoRA's ``alpha / sqrt(r)`` is folded in, so it also round-trips).
    """
    for layer in exportable_layers(model, adapter_name):
        yield layer.path, layer.down, layer.up, layer.kohya_alpha


# --------------------------------------------------------------------------- hashes
def _data_region_sha256(blob: io.BufferedIOBase) -> str:
    blob.seek(0)
    n = int.from_bytes(blob.read(8), "little")
    blob.seek(8 + n)
    h = hashlib.sha256()
    for chunk in iter(lambda: blob.read(1024 * 1024), b""):
        h.update(chunk)
    return h.hexdigest()


def _legacy_hash(blob: io.BufferedIOBase) -> str:
    blob.seek(0x100000)
    return hashlib.sha256(blob.read(0x10000)).hexdigest()[0:8]


def precalculate_sshs_hashes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) exactly as kohya's ``precalculate_safetensors_hashes``.

    The model hash is the sha256 of the tensor data region (everything after the
    8-byte length and the JSON header), so it does not depend on metadata; the
    legacy hash reads a fixed byte window of the file serialised with only the
    ``ss_*`` metadata, as sd-webui-additional-networks expects.
    """
    from safetensors.torch import save

    ss_only = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    blob = io.BytesIO(save(tensors, ss_only))
    return _data_region_sha256(blob), _legacy_hash(blob)


def compute_sshs_hash(path: str | Path) -> str:
    """sha256 of a .safetensors file's tensor data region (A1111 additional-networks' "model hash")."""
    with open(path, "rb") as f:
        return _data_region_sha256(f)


def read_lora_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored in a .safetensors header (empty dict if none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# --------------------------------------------------------------------------- metadata
def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)) and not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def build_kohya_metadata(
    path: Path, family, *, rank: int, alpha: float, metadata: dict[str, Any] | None = None
) -> dict[str, str]:
    """Defaults from the family and the file name, overlaid with the caller's metadata; all values strings."""
    now = time.time()
    w, h = family.default_resolution
    out: dict[str, str] = {
        "ss_network_module": "networks.lora",
        "ss_v2": str(bool(family.is_v2)),
        "ss_base_model_version": family.base_model_version,
        "ss_output_name": path.stem,
        "ss_sd_model_name": "",
        "ss_resolution": f"({w}, {h})",
        "ss_tag_frequency": "{}",
        "ss_training_started_at": str(now),
        "ss_training_finished_at": str(now),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": family.modelspec_architecture,
        "modelspec.implementation": family.modelspec_implementation,
        "modelspec.title": path.stem,
        "modelspec.date": _dt.datetime.fromtimestamp(now).isoformat(timespec="seconds"),
        "modelspec.resolution": f"{w}x{h}",
    }
    for key, value in (metadata or {}).items():
        if value is not None:
            out[key] = _as_str(value)
    # The numbers that decide how the file is applied are ours, not the caller's.
    out["ss_network_module"] = "networks.lora"
    out["ss_network_dim"] = str(int(rank))
    out["ss_network_alpha"] = str(float(alpha))
    return out


# --------------------------------------------------------------------------- writing
def _check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise FileExistsError(f"'{path}' already exists; choose another name or pass overwrite=True to replace it.")
    path.parent.mkdir(parents=True, exist_ok=True)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def kohya_named_layers(unet, text_encoders: list | None, family, walk) -> Iterator[tuple[str, Any]]:
    """(kohya module name, what `walk(model)` yields after the module path) for the UNet, then each text
    encoder under its family prefix; `walk` is a layer walker that yields (module path, ...)."""
    if unet is not None:  # the family names its denoiser's modules (its folder's names: SGM, BFL's LyCORIS, ...)
        for path, *rest in walk(unet):
            yield family.kohya_denoiser_name(path, unet), rest
    text_encoders = [te for te in (text_encoders or [])]
    prefixes = list(family.text_encoder_kohya_prefixes)
    for i, te in enumerate(text_encoders):
        if te is None:
            continue
        if i >= len(prefixes):
            raise LoraExportError(f"The {family.name} family has {len(prefixes)} text encoder(s), but {len(text_encoders)} were given.")
        for path, *rest in walk(te):
            yield kohya_te_name(path, prefixes[i]), rest


def kohya_state_dict(
    unet, text_encoders: list | None, family, *, dtype: torch.dtype = torch.float16, adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """The kohya tensors (no metadata): lora_down / lora_up (and a DoRA layer's dora_scale) in ``dtype``, alpha as
    fp32 0-dim scalars; for LoHa /
    LoKr adapters the LyCORIS tensors (``hada_*`` / ``lokr_*`` and alpha) under the same module names."""
    from .lycoris import iter_lycoris_modules, lycoris_tensors, network_of

    fused = family.fused_lora_export  # FLUX.2: q/k/v fused under one name, the family writes its tensors
    if unet is not None and network_of(unwrap(unet)) == "lokr" and fused is not None:
        try:
            tensors = fused.lokr_tensors(iter_lycoris_modules(unwrap(unet), adapter_name), dtype)
        except ValueError as exc:
            raise LoraExportError(str(exc)) from None
    elif any(network_of(unwrap(m)) for m in [unet, *(text_encoders or [])] if m is not None):
        try:
            tensors = lycoris_tensors(((name, parts) for name, (parts,) in kohya_named_layers(
                unet, text_encoders, family, lambda m: iter_lycoris_modules(m, adapter_name))), dtype)
        except ValueError as exc:
            raise LoraExportError(str(exc)) from None
    elif fused is not None:  # not one module per name
        if any(te is not None for te in text_encoders or []):
            raise LoraExportError(f"The {family.name} family trains no text encoder, so none can be exported.")
        try:
            tensors = fused.lora_tensors(list(exportable_layers(unwrap(unet), adapter_name)), dtype) \
                if unet is not None else {}
        except ValueError as exc:
            raise LoraExportError(str(exc)) from None
    else:
        tensors = {}
        walk = lambda m: ((layer.path, layer) for layer in exportable_layers(m, adapter_name))  # noqa: E731
        for name, (layer,) in kohya_named_layers(unet, text_encoders, family, walk):
            k_down, k_up, k_alpha = kohya_keys(name)
            if k_down in tensors:
                raise LoraExportError(f"Two LoRA layers map to the same kohya name '{name}'.")
            tensors[k_down] = layer.down.detach().to(device="cpu", dtype=dtype).contiguous().clone()
            tensors[k_up] = layer.up.detach().to(device="cpu", dtype=dtype).contiguous().clone()
            tensors[k_alpha] = torch.tensor(float(layer.kohya_alpha), dtype=torch.float32)
            if layer.magnitude is not None:
                tensors[f"{name}.{DORA_SCALE}"] = dora_scale(layer).to(device="cpu", dtype=dtype).contiguous().clone()
    if not tensors:
        raise LoraExportError("No LoRA layers were found in the given models, so there is nothing to export.")
    return tensors


def export_kohya_lora(
    path: str | Path,
    unet,
    text_encoders: list | None,
    family,
    *,
    rank: int,
    alpha: float,
    metadata: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
    overwrite: bool = False,
    adapter_name: str = "default",
    embeddings: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a kohya/A1111-format LoRA ``.safetensors`` and return its path. ``embeddings``: pivotal tuning's
    ``bundle_emb.*`` tensors (lora/pivotal.py ``bundle_tensors``), written beside the LoRA's.

    ``rank`` / ``alpha`` go into ``ss_network_dim`` / ``ss_network_alpha``; the
    per-module ``.alpha`` tensors come from the PEFT layers themselves, so the
    file always applies exactly the scale the model was trained with. The file
    is written to a temporary name and renamed; an existing file is replaced
    only with ``overwrite=True``.
    """
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise LoraExportError(f"A kohya LoRA must be a .safetensors file, not '{path.name}'.")
    _check_target(path, overwrite)
    tensors = kohya_state_dict(unet, text_encoders, family, dtype=dtype, adapter_name=adapter_name)
    tensors.update(embeddings or {})
    meta = build_kohya_metadata(path, family, rank=rank, alpha=alpha, metadata=metadata)
    algo = next((key.rsplit(".", 1)[1].split("_")[0] for key in tensors if ".hada_" in key or ".lokr_" in key),
                None)  # the part's name, after the last dot (a FLUX.2 LoKr's module name has dots)
    if algo:  # how kohya's sd-scripts record a LyCORIS network, so A1111's and ComfyUI's info panels say it
        meta["ss_network_module"] = "lycoris.kohya"
        meta["ss_network_args"] = json.dumps({"algo": {"hada": "loha", "lokr": "lokr"}[algo]})
    elif any(key.endswith(f".{DORA_SCALE}") for key in tensors):  # as LyCORIS records a DoRA-trained LoRA
        meta["ss_network_module"] = "lycoris.kohya"
        meta["ss_network_args"] = json.dumps({"algo": "lora", "dora_wd": "True"})
    meta["sshs_model_hash"], meta["sshs_legacy_hash"] = precalculate_sshs_hashes(tensors, meta)
    _atomic_save(tensors, path, meta)
    return path


def export_diffusers_lora(
    out_dir: str | Path,
    unet,
    text_encoders: list | None,
    family,
    *,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    adapter_name: str = "default",
    weight_name: str = "pytorch_lora_weights.safetensors",
) -> Path:
    """Write the diffusers/PEFT format (as ``train_text_to_image_lora.py`` does) and return the file's path.

    The PEFT LoRA configs are stored in the file too, so diffusers restores
    ``lora_alpha`` (and any rank/alpha patterns) instead of assuming alpha == rank.
    """
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    out_dir = Path(out_dir)
    target = out_dir / weight_name
    _check_target(target, overwrite)
    pipeline_cls = getattr(diffusers, family.diffusers_pipeline_class)

    def layers(model):
        model = unwrap(model)
        if any(layer.magnitude is not None for layer in iter_lora_layers(model, adapter_name)):
            raise LoraExportError("diffusers applies DoRA per output channel, not per input channel as StableTune "
                                  "and the WebUIs do; export DoRA in the kohya/A1111 format only.")
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        if not state:
            return None, None
        config = model.peft_config[adapter_name].to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        # Dropout is a training-time knob; diffusers builds the loaded LoRA's dropout modules in train
        # mode, so a stored p > 0 would make every later inference random.
        config["lora_dropout"] = 0.0
        # FLUX.2's loader drops `to_q.lora.down`-style names of attention layers, so it gets peft's own names, as
        # diffusers' Klein script saves them; and since ComfyUI reads those files without their metadata (scale 1),
        # each layer's alpha / rank is folded into its lora_B and the stored alpha made equal to the rank.
        peft_names = family.diffusers_lora_uses_peft_names
        if peft_names:
            state = {k: v.detach().float() for k, v in state.items()}
            for layer in iter_lora_layers(model, adapter_name):
                state[f"{layer.path}.lora_B.weight"] = state[f"{layer.path}.lora_B.weight"] * layer.scaling
            config.update(lora_alpha=config["r"], alpha_pattern=dict(config.get("rank_pattern") or {}),
                          use_rslora=False)
        state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}
        return (state if peft_names else convert_state_dict_to_diffusers(state)), config

    kwargs: dict[str, Any] = {}
    unet_layers, unet_cfg = layers(unet)
    denoiser = family.diffusers_lora_layers_argument  # FLUX.2: transformer_...
    if unet_layers:
        kwargs[denoiser] = unet_layers
        kwargs[denoiser.replace("_lora_layers", "_lora_adapter_metadata")] = unet_cfg
    names = ["text_encoder", "text_encoder_2"]
    for i, te in enumerate(text_encoders or []):
        if te is None:
            continue
        te_layers, te_cfg = layers(te)
        if te_layers:
            kwargs[f"{names[i]}_lora_layers"], kwargs[f"{names[i]}_lora_adapter_metadata"] = te_layers, te_cfg
    if not any(k.endswith("_lora_layers") for k in kwargs):
        raise LoraExportError("No LoRA layers were found in the given models, so there is nothing to export.")

    with atomic_path(target) as tmp:
        pipeline_cls.save_lora_weights(str(tmp.parent), weight_name=tmp.name, safe_serialization=True, **kwargs)
    return target


def write_embedding_files(folder: Path, vectors: dict[str, list[torch.Tensor]], family, dtype: torch.dtype
                          ) -> list[Path]:
    """One embedding file per new token (lora/pivotal.py's layout, which A1111, ComfyUI and diffusers'
    ``load_textual_inversion`` read) in ``folder``, each written to a temporary name and renamed; returns them."""
    from .pivotal import embedding_file_name, embedding_file_tensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for token, per_encoder in vectors.items():
        target = folder / f"{embedding_file_name(token)}.safetensors"
        _atomic_save(embedding_file_tensors(per_encoder, family, dtype), target, {"stabletune_token": token})
        written.append(target)
    return written
