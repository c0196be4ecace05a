"""`python -m stabletune_core merge`: bake LoRAs into a checkpoint, or merge several LoRAs into one.

* `merge --model BASE --lora a.safetensors:0.8 [b.safetensors:0.5 ...] --output OUT`: a new checkpoint with
  the LoRAs applied as the WebUIs apply them at those weights (LoRA, LoHa, LoKr and DoRA files). OUT ending in
  `.safetensors` is a single file in the original layout (SD's, which A1111, Forge and ComfyUI load; FLUX.2
  Klein's BFL transformer file, which ComfyUI loads); any other OUT is a diffusers folder. From a single-file
  BASE, only the tensors the LoRAs change are replaced: every other tensor (the VAE, extra keys) is copied bit
  for bit, in its own dtype.
* `merge --lora a.safetensors:0.7 b.safetensors:0.3 --rank 16 --output c.safetensors`: one LoRA whose update
  is the weighted sum of theirs, brought to `--rank` (or the rank keeping `--energy` of each module's
  ||dW||^2) by SVD; exact when the sum's rank fits.

The inputs are never changed and OUT must not exist.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

from .common import check_new_output, progress, refuse

PRECISIONS = ("fp16", "bf16", "fp32")


def add_parser(commands: Any) -> None:
    p = commands.add_parser("merge", help="Merge LoRAs into a checkpoint (--model), or several LoRAs into one "
                            "(SVD to --rank); writes a new file, never over an input.")
    p.add_argument("--lora", nargs="+", required=True, metavar="FILE[:WEIGHT]",
                   help="LoRA files, each with an optional weight (default 1.0), e.g. style.safetensors:0.7.")
    p.add_argument("--output", required=True, help="A new .safetensors file, or (with --model) a new folder for "
                   "the diffusers layout.")
    p.add_argument("--model", default=None, help="The checkpoint to merge into: a single .safetensors file or a "
                   "diffusers folder.")
    p.add_argument("--model_config_dir", default=None, help="For a single file of an unusual architecture: the "
                   "diffusers-layout config folder describing it (as the train knob).")
    p.add_argument("--save_precision", choices=("same", *PRECISIONS), default="same",
                   help="dtype of the written weights (same: as the input checkpoint's; LoRAs: fp16).")
    p.add_argument("--rank", type=int, default=None, help="Rank of the merged LoRA (default: the largest input rank).")
    p.add_argument("--energy", type=float, default=None, help="Per module, the smallest rank keeping this "
                   "fraction of ||dW||^2 (with --rank as the ceiling).")
    p.set_defaults(run_tool=run)


MAX_WEIGHT = 100.0  # a WebUI multiplier is about -2..2; beyond this a weight is a typo that makes weights inf


def parse_weighted(specs: list[str]) -> list[tuple[Path, float]]:
    out = []
    for spec in specs:
        path, weight = spec, 1.0
        head, sep, tail = spec.rpartition(":")
        if sep and head:
            try:
                path, weight = head, float(tail)
            except ValueError:
                path = spec  # a ':' inside the path, not a weight
        if not (math.isfinite(weight) and 0 < abs(weight) <= MAX_WEIGHT):
            raise refuse(f"The weight {tail} of {Path(path).name} is not a LoRA weight; give a number other than 0 "
                         f"between -{MAX_WEIGHT:g} and {MAX_WEIGHT:g}, e.g. {Path(path).name}:0.8.")
        out.append((Path(path).expanduser(), weight))
    return out


def input_labels(paths: list[Path]) -> list[str]:
    """How sentences name the inputs: the file name, or as many of its last folders as tell two inputs of the same
    name apart (style/a.safetensors, face/a.safetensors)."""
    resolved = [Path(p).expanduser().absolute() for p in paths]
    labels = []
    for path in resolved:
        depth = 1
        while depth < len(path.parts) and any(other != path and other.parts[-depth:] == path.parts[-depth:]
                                              for other in resolved):
            depth += 1
        labels.append("/".join(path.parts[-depth:]))
    return labels


# ------------------------------------------------------------------------------------- into a model
def base_family(model: str) -> str:
    from ..config import safetensors_problem
    from ..models import detect_family

    path = Path(model).expanduser()
    if not path.exists():
        raise refuse(f"The checkpoint {model} does not exist; give a .safetensors file or a diffusers folder.")
    if path.is_file() and (problem := safetensors_problem(path)):
        raise refuse(f"The checkpoint {path} {problem}; give a complete .safetensors file or a diffusers folder.")
    return detect_family(path)


def load_base(model: str, config_dir: str | None, family_name: str | None = None):
    from ..models import ModelLoadError, get_family

    path = Path(model).expanduser()
    family = get_family(family_name or base_family(model))
    try:
        return family.load(str(path), local_files_only=True, config_dir=config_dir)
    except ModelLoadError as exc:
        raise refuse(str(exc)) from None


def read_loras(loras: list[tuple[Path, float]], family: str) -> list[tuple[Path, float, dict[str, Any]]]:
    """Every file read and checked against the model's family before the model loads."""
    from .lora_file import check_family, read_adapter

    read = []
    for path, weight in loras:
        modules, metadata = read_adapter(path)
        check_family(path, modules, metadata, family)
        read.append((path, weight, modules))
    return read


def merge_into(bundle, read: list[tuple[Path, float, dict[str, Any]]]) -> tuple[set[str], list[dict[str, Any]]]:
    """Add each LoRA's update at its weight to the bundle's layers (in memory; nothing is written here). Returns
    the components changed ("unet", "text_encoder", "text_encoder_2") and a record per LoRA for the metadata."""
    import torch

    from ..lora.export import compute_sshs_hash
    from .lora_file import kohya_layers

    layers = kohya_layers(bundle)
    owner = {id(m): "unet" for m in bundle.denoiser.modules()}
    for i, encoder in enumerate(bundle.text_encoders):
        owner.update({id(m): "text_encoder" if i == 0 else "text_encoder_2" for m in encoder.modules()})
    labels = input_labels([path for path, _, _ in read])
    for label, (path, _, modules) in zip(labels, read):  # every file's names are checked before any layer changes
        missing = [name for name in modules if name not in layers]
        if missing:
            raise refuse(f"{label} has modules this {bundle.family.display_name} model lacks (e.g. "
                         f"'{missing[0]}'); it was made for another model or another layout.")
    changed: set[str] = set()
    records = []
    with torch.no_grad():
        for label, (path, weight, modules) in zip(labels, read):
            for module in progress(modules.values(), len(modules), f"merging {label}", unit="module"):
                target = layers[module.name]
                try:
                    delta = module.delta(target.weight)
                except (ValueError, RuntimeError):
                    raise refuse(f"{label}: '{module.name}' does not fit this model's layer of shape "
                                 f"{tuple(target.weight.shape)}; the LoRA was made for another model family.") from None
                target.add(weight * delta)
                changed.add(owner[id(target.layers[0])])
            records.append({"file": label, "weight": weight, "sshs_model_hash": compute_sshs_hash(path),
                            "kind": sorted({m.kind for m in modules.values()})})
    return changed, records


def original_layout(bundle, components: set[str] | None = None) -> dict[str, Any]:
    """The given components' tensors (None: the whole model) under their original checkpoint keys, the family's
    single-file layout; one sentence for a family that has none."""
    from ..models import ModelLoadError

    family = bundle.family
    try:
        if components is None:
            return family.full_original_state_dict(bundle)
        return family.original_state_dict(bundle, components)
    except ModelLoadError as exc:
        raise refuse(str(exc)) from None


def write_single_file(bundle, source: Path, target: Path, components: set[str], dtype, note: dict[str, Any]) -> int:
    """Write the merged model as one original-layout file; returns how many tensors differ from the source."""
    import torch
    from safetensors import safe_open

    from ..lora.export import _atomic_save
    from ..models.flux2_klein.single_file import DIFFUSION_MODEL_PREFIX

    if source.is_file():
        with safe_open(str(source), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            metadata = dict(f.metadata() or {})
        replaced = 0
        for key, value in original_layout(bundle, components).items():
            if key not in state and DIFFUSION_MODEL_PREFIX + key in state:  # an all-in-one file's transformer
                key = DIFFUSION_MODEL_PREFIX + key
            if key not in state:
                if key.endswith("position_ids"):
                    continue
                raise refuse(f"{source.name} stores its weights under other names than StableTune writes (no "
                             f"'{key}'); write a diffusers folder instead (an output path without .safetensors).")
            old = state[key]
            new = value.to(old.dtype).reshape(old.shape)
            if not torch.equal(new, old):
                state[key] = new
                replaced += 1
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    else:
        state = {k: v.to(dtype or torch.float16) if v.is_floating_point() else v
                 for k, v in original_layout(bundle).items()}
        metadata, replaced = {"format": "pt"}, -1
    metadata["stabletune_merge"] = json.dumps(note)
    _atomic_save({k: v.contiguous() for k, v in state.items()}, target, metadata)
    return replaced


def write_folder(bundle, source: Path, target: Path, dtype, note: dict[str, Any],
                 config_dir: str | None) -> None:
    """Write the merged model as a diffusers folder (atomically: the folder appears whole or not at all)."""
    from ..atomic import atomic_path

    family = bundle.family
    layout = source if source.is_dir() else Path(config_dir) if config_dir else family.single_file_config_dir(source)
    with atomic_path(target, folder=True) as tmp:
        shutil.copy(layout / "model_index.json", tmp / "model_index.json")
        for part in ("scheduler", *family.tokenizer_parts):
            shutil.copytree(layout / part, tmp / part)
        modules = {denoiser_part(bundle): bundle.denoiser, "vae": bundle.vae}
        modules.update(zip(family.text_encoder_parts, bundle.text_encoders))
        for name, module in modules.items():
            module.to(dtype).save_pretrained(str(tmp / name), safe_serialization=True)
        (tmp / "stabletune_merge.json").write_text(json.dumps(note, indent=1))


def denoiser_part(bundle) -> str:
    """The diffusers folder name of the bundle's denoiser ("unet", a transformer family's "transformer")."""
    return bundle.family.denoiser_folder


def source_dtype(source: Path):
    """The dtype a checkpoint stores its UNet in (what --save_precision same keeps when the layout changes)."""
    import torch
    from safetensors import safe_open

    folder = next((source / part for part in ("unet", "transformer") if (source / part).is_dir()), source / "unet")
    files = sorted(folder.glob("*.safetensors")) if source.is_dir() else [source]
    if not files or not files[0].is_file():
        return torch.float32
    with safe_open(str(files[0]), framework="pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in list(f.keys())[:50]}
    return torch.float16 if "F16" in stored else torch.bfloat16 if "BF16" in stored else torch.float32


def merge_checkpoint(model: str, loras: list[tuple[Path, float]], output: Path, *, save_precision: str = "same",
                     config_dir: str | None = None) -> str:
    from ..models import get_family
    from ..train.amp import precision_dtype

    source = Path(model).expanduser()
    family = base_family(model)
    read = read_loras(loras, family)  # one sentence for a LoRA of another family, before the model loads
    if source.is_file() and output.suffix.lower() != ".safetensors" and \
            not get_family(family).single_file_merges_into_folder:
        raise refuse(f"A {get_family(family).display_name} model given as its transformer file merges into a "
                     "single file; give an output path ending in .safetensors (or merge into its diffusers folder).")
    bundle = load_base(model, config_dir, family)
    components, records = merge_into(bundle, read)
    note = {"base": source.name, "loras": records}
    words = words_left_out(loras)
    if output.suffix.lower() == ".safetensors":
        # from a single file, "same" keeps every tensor's own dtype
        dtype = None if save_precision == "same" and source.is_file() else \
            source_dtype(source) if save_precision == "same" else precision_dtype(save_precision)
        replaced = write_single_file(bundle, source, output, components, dtype, note)
        kept = f"; {replaced} tensors changed, every other one copied as it was" if replaced >= 0 else ""
        layout = f"{bundle.family.display_name}'s original layout"
        return f"Merged checkpoint written to {output} (single file, {layout}{kept}).{words}"
    dtype = source_dtype(source) if save_precision == "same" else precision_dtype(save_precision)
    write_folder(bundle, source, output, dtype, note, config_dir)
    return f"Merged checkpoint written to {output} (diffusers folder).{words}"


def words_left_out(loras: list[tuple[Path, float]]) -> str:
    """A sentence naming the pivotal-tuning words bundled in the LoRAs, which a checkpoint does not take (a word is
    added to the prompt's vocabulary, not to a weight): they stay usable from the run's embedding files."""
    from .lora_file import bundled_words, word_names

    labels = input_labels([path for path, _ in loras])
    found = [f"{', '.join(word_names(words))} of {label}" for label, (path, _) in zip(labels, loras)
             if (words := bundled_words(path))]
    if not found:
        return ""
    return (f" The words {'; '.join(found)} (bundle_emb) are not part of a checkpoint: use them through the LoRA "
            "file or its run's NAME_embeddings files.")


# ---------------------------------------------------------------------------------- several LoRAs
def merge_loras(loras: list[tuple[Path, float]], output: Path, *, rank: int | None = None,
                energy: float | None = None, save_precision: str = "same") -> tuple[str, list[Any]]:
    """One LoRA from several: per module, the weighted factors side by side (up_i x w_i x alpha_i / r_i next to
    each other, down_i stacked) multiply to the weighted sum of the updates; the resize's SVD (two thin QRs and a
    small SVD) then keeps its best rank-N part."""
    import torch

    from ..lora.export import _atomic_save, precalculate_sshs_hashes
    from ..lora.names import ALPHA, DOWN, UP
    from ..lora.resize import ModuleResize, chosen_rank, truncated_factors
    from ..lora.svd import spectra
    from ..train.amp import precision_dtype
    from .lora_file import AdapterModule, family_display_name, family_of_file, read_adapter

    if len(loras) < 2:
        raise refuse("Give two or more LoRA files (--lora) to merge into one, or a checkpoint (--model) to merge "
                     "them into.")
    read: list[tuple[Path, float, dict[str, AdapterModule], dict[str, str]]] = []
    labels = input_labels([path for path, _ in loras])
    families: dict[str, str] = {}  # family -> the first input made for it
    for label, (path, weight) in zip(labels, loras):
        modules, metadata = read_adapter(path)
        odd = next((m for m in modules.values() if m.kind != "lora"), None)
        if odd is not None:
            raise refuse(f"{label} is a {odd.kind.upper() if odd.kind == 'dora' else odd.kind.capitalize()} file; "
                         "merging LoRAs into one takes plain LoRA files (merge it into a checkpoint with --model).")
        made_for = family_of_file(modules, metadata)
        if made_for:
            families.setdefault(made_for, label)
        read.append((path, weight, modules, metadata))
    if len(families) > 1:
        (one, first), (other, second) = list(families.items())[:2]
        raise refuse(f"{first} is a {family_display_name(one)} LoRA and {second} a {family_display_name(other)} "
                     "LoRA; merge LoRAs made for one model family.")
    largest = max(m.rank for _, _, modules, _ in read for m in modules.values())
    if rank is not None and rank < 1:
        raise refuse(f"The rank {rank} (--rank) is not a rank; give a whole number of 1 or more.")
    most = max(sum(modules[name].rank for _, _, modules, _ in read if name in modules)
               for name in {name for _, _, modules, _ in read for name in modules})
    if rank is not None and rank > most:
        raise refuse(f"The rank {rank} (--rank) is more than any merged module can use (at most {most}, the input "
                     f"ranks added up); give {most} or less.")
    if energy is not None and not 0 < energy <= 1:
        raise refuse(f"The energy {energy} (--energy) is not a fraction; give a number above 0 and at most 1, "
                     "e.g. 0.95.")
    # with --energy alone every module may keep as many directions as its stacked factors have
    ceiling = rank if rank is not None else None if energy is not None else largest
    names = sorted({name for _, _, modules, _ in read for name in modules})
    stacked = []
    for name in names:
        parts = [(w, modules[name]) for _, w, modules, _ in read if name in modules]
        shapes = {tuple(m.parts[DOWN].shape[1:]) for _, m in parts} | {None}
        if len(shapes) > 2 or len({tuple(m.parts[UP].shape[0:1]) for _, m in parts}) > 1:
            raise refuse(f"'{name}' has different shapes in these LoRAs; they were made for different models.")
        down = torch.cat([m.parts[DOWN].double().flatten(1) for _, m in parts], dim=0)
        up = torch.cat([m.parts[UP].double().flatten(1) * (w * m.scale) for w, m in parts], dim=1)
        stacked.append((name, down, up, parts[0][1]))
    found = spectra([(name, down.float(), up.float(), 1.0) for name, down, up, _ in stacked])
    tensors: dict[str, torch.Tensor] = {}
    report = []
    for (name, down, up, first), spectrum in zip(stacked, found):
        new, kept = chosen_rank(spectrum, ceiling, energy)
        if energy is None:
            new = ceiling  # every module at --rank (thinner ones padded with zero directions), as kohya writes
        new_down, new_up = truncated_factors(down, up, new)
        dtype = first.parts[DOWN].dtype if save_precision == "same" else precision_dtype(save_precision)
        tensors[f"{name}.{DOWN}"] = new_down.reshape(new, *first.parts[DOWN].shape[1:]).to(dtype).contiguous()
        tensors[f"{name}.{UP}"] = new_up.reshape(first.parts[UP].shape[0], new,
                                                 *first.parts[UP].shape[2:]).to(dtype).contiguous()
        tensors[f"{name}.{ALPHA}"] = torch.tensor(float(new), dtype=torch.float32)  # alpha / rank = 1
        report.append(ModuleResize(name, down.shape[0], new, kept))
    ranks = {m.new_rank for m in report}
    energies = [m.energy_kept for m in report]
    how = (f"energy {energy}" + (f", at most rank {rank}" if rank else "")) if energy else f"rank {ceiling}"
    sources = [{"file": label, "weight": w, "sshs_model_hash": md.get("sshs_model_hash", "")}
               for label, (_, w, _, md) in zip(labels, read)]
    metadata = {k: v for k, v in read[0][3].items() if k not in ("ss_network_args", "stabletune_resize")}
    note = (f"merged by SVD ({how}) from " + ", ".join(f"{s['file']} x{s['weight']:g}" for s in sources) +
            f"; energy kept per module: min {min(energies):.2%}, mean {sum(energies) / len(energies):.2%}")
    single = ranks.pop() if len(ranks) == 1 else None  # kohya writes "Dynamic" when modules differ
    metadata.update({"ss_network_module": "networks.lora",
                     "ss_network_dim": str(single) if single else "Dynamic",
                     "ss_network_alpha": str(float(single)) if single else "Dynamic",
                     "ss_output_name": output.stem, "modelspec.title": output.stem,
                     "ss_training_comment": note, "stabletune_merge": json.dumps(sources)})
    frequency: dict[str, Any] = {}
    for _, _, _, md in read:
        try:
            frequency.update(json.loads(md.get("ss_tag_frequency", "{}")))
        except json.JSONDecodeError:
            pass
    metadata["ss_tag_frequency"] = json.dumps(frequency, ensure_ascii=False)
    tensors.update(carried_words(loras))
    metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = precalculate_sshs_hashes(tensors, metadata)
    _atomic_save(tensors, output, metadata)
    return note, report


def carried_words(loras: list[tuple[Path, float]]) -> dict[str, Any]:
    """The pivotal-tuning words bundled in the input LoRAs, as they are, for the merged LoRA (a word has no weight
    to scale: it means what it was trained to mean, or the prompt leaves it out). The same word in two files is
    refused: one of them would be silently dropped."""
    from .lora_file import bundled_words, word_names

    carried: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for label, (path, _) in zip(input_labels([path for path, _ in loras]), loras):
        words = bundled_words(path)
        for word in word_names(words):
            if word in owner:
                raise refuse(f"{owner[word]} and {label} both bundle the word {word}; merge LoRAs whose "
                             "pivotal-tuning words differ.")
            owner[word] = label
        carried.update(words)
    return carried


def run(args: argparse.Namespace) -> int:
    output = Path(args.output).expanduser()
    check_new_output(output)
    loras = parse_weighted(args.lora)
    for path, _ in loras:
        if not path.is_file():
            raise refuse(f"The LoRA file {path} does not exist; give the path of a .safetensors LoRA.")
        if path.resolve() == output.resolve():
            raise refuse("The output path (--output) names an input file; the tools never write over their inputs.")
    if args.model:
        if args.rank is not None or args.energy is not None:
            raise refuse("A rank or an energy (--rank, --energy) is for merging LoRAs into one; a merge into a "
                         "checkpoint has no rank.")
        print(merge_checkpoint(args.model, loras, output, save_precision=args.save_precision,
                               config_dir=args.model_config_dir))
        return 0
    if output.suffix.lower() != ".safetensors":
        raise refuse(f"The merged LoRA must be a .safetensors file, not '{output.name}'; give an output path ending "
                     "in .safetensors.")
    from ..lora.resize import report_table

    note, report = merge_loras(loras, output, rank=args.rank, energy=args.energy, save_precision=args.save_precision)
    print(report_table(report))
    print(f"Merged LoRA written to {output} ({note}).")
    return 0
