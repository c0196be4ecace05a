"""Issue 23, part 1, item 4: LoRA (and DoRA, LoHa, LoKr) on the Klein transformer through lora/inject.py, written in
the layouts diffusers' Flux2KleinPipeline.load_lora_weights and ComfyUI load, so that the loaded model computes
what the trained one did.

diffusers is installed: its real loader reads our files. ComfyUI's rules are re-stated here independently (as
tests/test_export_keys.py does for SD), from comfy/lora.py (model_lora_keys_unet: ``lora_unet_`` + the checkpoint
key, and for Flux models ``lycoris_`` / ``transformer.`` + the diffusers path through utils.flux_to_diffusers,
which maps q, k, v onto thirds of the fused qkv weight; read at Comfy-Org/ComfyUI ec93dcacb96b and b3be02d6e766,
see comfy_key_map) and comfy/weight_adapter (lora: alpha / rank x up @ down,
DoRA normalised per input channel of the patched slice; loha; lokr): the patched checkpoint must compute what our
adapted model computes.
"""
from __future__ import annotations

import re

import pytest
import torch

from flux2_tools import one_sentence, tiny_klein_paths
from stabletune_core.config import ConfigError, build_config
from stabletune_core.lora.export import export_diffusers_lora, export_kohya_lora, read_lora_metadata
from stabletune_core.lora.inject import add_lora
from stabletune_core.models import get_family
from stabletune_core.models.flux2_klein.family import LORA_PRESETS
from stabletune_core.models.flux2_klein.single_file import transformer_from_bfl, transformer_to_bfl

TOLERANCE = 1e-5  # max |difference| of transformer outputs of size ~1, all in float32 (files written in fp32)
ALL_KOHYA = LORA_PRESETS["attention_mlp"] + ["x_embedder", "context_embedder", "proj_out",
                                             "time_guidance_embed.timestep_embedder.linear_1"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


def adapted(paths, targets, network="lora", rank=4, alpha=2.0, seed=0):
    """A fresh tiny Klein with trained-looking (non-zero, deterministic) adapters."""
    bundle = get_family("flux2_klein").load(paths["folder"])
    dora = network == "dora"
    add_lora(bundle, build_config(dict(unet_lora_targets=targets, lora_rank=rank, lora_alpha=alpha,
                                       network_type="lora" if dora else network, use_dora=dora)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bundle.denoiser.named_parameters():
            if p.requires_grad:
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    bundle.denoiser.eval()
    return bundle


def inputs(seed=0):
    from diffusers import Flux2KleinPipeline

    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 16, 4, 4, generator=g)
    text = torch.randn(2, 7, 48, generator=g)
    return dict(hidden_states=Flux2KleinPipeline._pack_latents(latents), encoder_hidden_states=text,
                timestep=torch.tensor([0.3, 0.8]), img_ids=Flux2KleinPipeline._prepare_latent_ids(latents),
                txt_ids=Flux2KleinPipeline._prepare_text_ids(text), guidance=None, return_dict=False)


@torch.no_grad()
def output(transformer, seed=0):
    return transformer(**inputs(seed))[0]


def fresh_pipeline(paths):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(str(paths["folder"]), local_files_only=True)


# ---- presets and custom targets ----------------------------------------------------------------------------------
def adapted_names(bundle):
    from stabletune_core.lora.layers import iter_lora_layers

    return [layer.path for layer in iter_lora_layers(bundle.denoiser)]


def test_presets_and_a_custom_list_pick_the_transformers_linear_layers(paths, one_thread):
    names = adapted_names(adapted(paths, LORA_PRESETS["attention"]))
    assert len(names) == 2 * 8 + 2 * 2  # two double blocks x 8 attention layers, two single blocks x 2
    assert "single_transformer_blocks.1.attn.to_out" in names and "transformer_blocks.0.attn.add_v_proj" in names
    mlp = adapted_names(adapted(paths, LORA_PRESETS["attention_mlp"]))
    assert len(mlp) == len(names) + 2 * 4 and "transformer_blocks.1.ff_context.linear_out" in mlp
    # "to_out" also names the double blocks' ModuleList: only the Linear layers get an adapter
    custom = adapted_names(adapted(paths, ["to_q", "to_out"]))
    assert custom == ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_q",
                      "single_transformer_blocks.0.attn.to_out", "single_transformer_blocks.1.attn.to_out"]
    from stabletune_core.lora.layers import iter_lora_layers
    from stabletune_core.lora.lycoris import iter_lycoris_modules, network_of

    dora = list(iter_lora_layers(adapted(paths, LORA_PRESETS["attention"], "dora").denoiser))
    assert len(dora) == len(names) and all(layer.dora_on_input for layer in dora)
    for network in ("loha", "lokr"):
        unet = adapted(paths, LORA_PRESETS["attention"], network).denoiser
        assert network_of(unet) == network and len(list(iter_lycoris_modules(unet))) == len(names)


def test_bad_targets_and_text_encoder_training_are_refused(paths):
    with pytest.raises(ConfigError) as err:
        adapted(paths, ["attn.to_qq", "to_k"])
    assert len(err.value.problems) == 1
    assert "'attn.to_qq' matches no layer of the transformer" in err.value.problems[0]
    assert "attn.to_q" in err.value.problems[0].split("closest")[1]
    bundle = get_family("flux2_klein").load(paths["folder"])
    with pytest.raises(ConfigError) as err:
        add_lora(bundle, build_config(dict(train_text_encoder=True, unet_lora_targets=["to_q"])))
    assert "text encoder stays frozen" in err.value.problems[0] and one_sentence(err.value.problems[0])


# ---- diffusers' real loader ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_lora_loads_in_diffusers_and_computes_what_we_trained(paths, fmt, tmp_path, one_thread):
    bundle = adapted(paths, ALL_KOHYA, rank=4, alpha=2.0)
    family = bundle.family
    if fmt == "kohya":
        file = export_kohya_lora(tmp_path / "klein.safetensors", bundle.denoiser, None, family, rank=4, alpha=2.0,
                                 dtype=torch.float32)
    else:
        file = export_diffusers_lora(tmp_path / "out", bundle.denoiser, None, family)
    pipe = fresh_pipeline(paths)
    base = output(pipe.transformer)
    loaded = pipe.lora_state_dict(str(file))
    trained = {f"transformer.{p}" for p in adapted_names(bundle)}
    assert {re.sub(r"\.lora(_[AB]|\.down|\.up)\.weight$", "", k) for k in loaded} == trained  # none dropped or extra
    pipe.load_lora_weights(str(file))
    ours, theirs = output(bundle.denoiser), output(pipe.transformer)
    assert (ours - base).abs().max() > 0.05  # the LoRA does change the model
    assert (ours - theirs).abs().max() <= TOLERANCE


def test_lokr_loads_in_diffusers(paths, tmp_path, one_thread):
    bundle = adapted(paths, LORA_PRESETS["attention_mlp"], network="lokr", rank=4, alpha=2.0)
    file = export_kohya_lora(tmp_path / "lokr.safetensors", bundle.denoiser, None, bundle.family, rank=4, alpha=2.0,
                             dtype=torch.float32)
    assert any(k.startswith("transformer.transformer_blocks.0.attn.to_q.lokr_") for k in read_keys(file))
    pipe = fresh_pipeline(paths)
    pipe.load_lora_weights(str(file))
    assert (output(bundle.denoiser) - output(pipe.transformer)).abs().max() <= TOLERANCE


def read_keys(file):
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_metadata_names_klein(paths, tmp_path):
    bundle = adapted(paths, LORA_PRESETS["attention"])
    meta = read_lora_metadata(export_kohya_lora(tmp_path / "m.safetensors", bundle.denoiser, None, bundle.family,
                                                rank=4, alpha=2.0))
    assert meta["ss_base_model_version"] == "flux2_klein_4b"  # as ai-toolkit writes it
    assert meta["modelspec.architecture"] == "Flux.2-klein-4b/lora"  # as musubi-tuner writes it
    assert meta["modelspec.implementation"] == "https://github.com/black-forest-labs/flux2"
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_v2"] == "False"


# ---- ComfyUI's rules, re-stated ----------------------------------------------------------------------------------
def comfy_key_map(bfl_keys, hidden, before_pr: int | None = None):
    """{LoRA module name: (checkpoint key, (dim, start, length) or None)}, as ComfyUI builds it for a Flux2 model
    (whose checkpoint keys are the BFL ones). Read at Comfy-Org/ComfyUI ec93dcacb96b (comfy/lora.py,
    model_lora_keys_unet: every checkpoint weight as ``lora_unet_`` + its key with '_' and as its bare key; for
    ``model_base.Flux`` each utils.flux_to_diffusers entry as ``transformer.`` / ``lycoris_`` /
    ``lora_transformer_`` / bare + the diffusers path, and ``.linear1_qkv``) and b3be02d6e766 (comfy/utils.py,
    flux_to_diffusers: the single blocks' ``attn.to_qkv_mlp_proj`` / ``attn.to_out`` came with PR #11981, 2026-01-20,
    the double blocks' ``ff.linear_in`` / ``ff.linear_out`` / ``ff_context.*`` with PR #11997, opened 2026-01-21).
    Only .weight entries matter here; a target the checkpoint lacks is ComfyUI's "NOT LOADED" (see the caller).
    `before_pr`: the table of a build before that pull request (11981 or 11997) was merged."""
    diffusers = {}  # flux_to_diffusers' .weight entries, diffusers path -> (BFL key, slice or None)
    blocks = {int(m[1]) for k in bfl_keys if (m := re.match(r"double_blocks\.(\d+)\.", k))}
    singles = {int(m[1]) for k in bfl_keys if (m := re.match(r"single_blocks\.(\d+)\.", k))}
    double_map = {"attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin",
                  "norm1_context.linear": "txt_mod.lin", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                  "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
                  "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",  # PR #11997 ("LyCoris LoKr")
                  "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
                  "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                  "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
    if before_pr is not None and before_pr <= 11997:
        double_map = {k: v for k, v in double_map.items() if ".linear_" not in k}
    for i in blocks:
        for j, p in enumerate("qkv"):
            diffusers[f"transformer_blocks.{i}.attn.to_{p}"] = (f"double_blocks.{i}.img_attn.qkv.weight",
                                                               (0, j * hidden, hidden))
            diffusers[f"transformer_blocks.{i}.attn.add_{p}_proj"] = (f"double_blocks.{i}.txt_attn.qkv.weight",
                                                                     (0, j * hidden, hidden))
        for ours, theirs in double_map.items():
            diffusers[f"transformer_blocks.{i}.{ours}"] = (f"double_blocks.{i}.{theirs}.weight", None)
    single_map = {"norm.linear": "modulation.lin", "proj_out": "linear2", "attn.norm_q": "norm.query_norm",
                  "attn.norm_k": "norm.key_norm",
                  "attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}  # PR #11981 ("Flux 2")
    if before_pr is not None and before_pr <= 11981:
        del single_map["attn.to_qkv_mlp_proj"], single_map["attn.to_out"]
    for i in singles:
        for j, p in enumerate("qkv"):  # FLUX.1's unfused names, slices of linear1
            diffusers[f"single_transformer_blocks.{i}.attn.to_{p}"] = (f"single_blocks.{i}.linear1.weight",
                                                                      (0, j * hidden, hidden))
        diffusers[f"single_transformer_blocks.{i}.proj_mlp"] = (f"single_blocks.{i}.linear1.weight",
                                                               (0, 3 * hidden, 4 * hidden))
        for ours, theirs in single_map.items():
            diffusers[f"single_transformer_blocks.{i}.{ours}"] = (f"single_blocks.{i}.{theirs}.weight", None)
    # MAP_BASIC (its swap_scale_shift entry norm_out.linear is left out: our files never adapt it)
    for ours, theirs in {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
                         "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",  # FLUX.1's names only
                         "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
                         "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
                         "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
                         "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                         "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
                         "controlnet_x_embedder": "pos_embed_input"}.items():
        diffusers[ours] = (f"{theirs}.weight", None)
    key_map = {}
    for key in bfl_keys:
        if key.endswith(".weight"):
            key_map["lora_unet_" + key[:-len(".weight")].replace(".", "_")] = (key, None)
            key_map[key[:-len(".weight")]] = (key, None)  # "generic lora format"
    for path, target in diffusers.items():
        for name in ("transformer." + path, "lycoris_" + path.replace(".", "_"),
                     "lora_transformer_" + path.replace(".", "_"), path):
            key_map[name] = target
    for key in bfl_keys:
        if key.endswith(".weight") and ".linear1." in key:
            key_map[key.replace(".linear1.weight", ".linear1_qkv")] = (key, (0, 0, hidden * 3))
    return key_map


def comfy_delta(tensors, name, weight):
    """The patched weight ComfyUI computes for one module (weight_adapter lora / loha / lokr, DoRA included)."""
    part = lambda k: tensors.get(f"{name}.{k}")  # noqa: E731
    alpha = part("alpha")
    if part("lora_up.weight") is not None or part("lora_B.weight") is not None:  # kohya's or peft's names
        up = part("lora_up.weight") if part("lora_up.weight") is not None else part("lora_B.weight")
        down = part("lora_down.weight") if part("lora_down.weight") is not None else part("lora_A.weight")
        diff = (up @ down) * (alpha.item() / down.shape[0] if alpha is not None else 1.0)
    elif part("hada_w1_a") is not None:
        diff = (part("hada_w1_a") @ part("hada_w1_b")) * (part("hada_w2_a") @ part("hada_w2_b"))
        diff = diff * alpha.item() / part("hada_w1_b").shape[0]
    else:
        w1 = part("lokr_w1") if part("lokr_w1") is not None else part("lokr_w1_a") @ part("lokr_w1_b")
        w2 = part("lokr_w2") if part("lokr_w2") is not None else part("lokr_w2_a") @ part("lokr_w2_b")
        low = part("lokr_w2_b") if part("lokr_w2_b") is not None else part("lokr_w1_b")
        diff = torch.kron(w1, w2) * (alpha.item() / low.shape[0] if low is not None and alpha is not None else 1.0)
    patched = weight + diff.reshape(weight.shape)
    if part("dora_scale") is not None:  # weight_decompose, per input channel (dora_scale is (1, in))
        norm = patched.norm(dim=0, keepdim=True) + torch.finfo(weight.dtype).eps
        patched = patched * (part("dora_scale") / norm)
    return patched


def comfy_module_names(tensors) -> set[str]:
    """The module names of a LoRA / LyCORIS file (its keys without the weight parts)."""
    return {re.sub(r"\.(lora_[AB]\.weight|lora_(up|down)\.weight|alpha|dora_scale|hada_\w+|lokr_\w+)$", "", k)
            for k in tensors}


def comfy_base(paths):
    """The tiny base transformer and its checkpoint under BFL keys, as ComfyUI holds it."""
    from diffusers import Flux2Transformer2DModel

    base = Flux2Transformer2DModel.from_pretrained(str(paths["folder"]), subfolder="transformer")
    return base, transformer_to_bfl(base.state_dict())


def comfy_patched_transformer(paths, tensors):
    """The tiny base checkpoint (BFL keys, as ComfyUI holds it) patched by the file's modules, back in diffusers."""
    base, bfl = comfy_base(paths)
    key_map = comfy_key_map(bfl, hidden=base.inner_dim)
    names = comfy_module_names(tensors)
    unmapped = names - key_map.keys()
    assert not unmapped, f"ComfyUI would not load {sorted(unmapped)[:3]}"  # its 'lora key not loaded'
    absent = {name for name in names if key_map[name][0] not in bfl}
    assert not absent, f"ComfyUI would not load {sorted(absent)[:3]}"  # its 'NOT LOADED': no such weight
    patched = {k: v.clone() for k, v in bfl.items()}
    for name in names:
        key, offset = key_map[name]
        view = patched[key] if offset is None else patched[key].narrow(*offset)
        view.copy_(comfy_delta(tensors, name, view.clone()))
    base.load_state_dict(transformer_from_bfl(patched))
    return base.eval()


@pytest.mark.parametrize("network", ["lora", "dora", "loha", "lokr"])
def test_comfyui_applies_our_file_as_trained(paths, network, tmp_path, one_thread):
    targets = ALL_KOHYA if network == "lora" else LORA_PRESETS["attention_mlp"]
    bundle = adapted(paths, targets, network=network, rank=4, alpha=2.0)
    file = export_kohya_lora(tmp_path / f"{network}.safetensors", bundle.denoiser, None, bundle.family, rank=4,
                             alpha=2.0, dtype=torch.float32)
    tensors = read_keys(file)
    prefixes = {k.split("_", 1)[0] for k in tensors}
    expected = {"lora": {"lora"}, "lokr": {"transformer.transformer", "transformer.single"}}.get(network, {"lycoris"})
    assert prefixes == expected  # fused BFL names / diffusers paths (LyCORIS names; LoKr: transformer.<path>)
    if network == "lora":
        assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors  # q, k, v fused, rank 12
        assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 12
    theirs = comfy_patched_transformer(paths, tensors)
    assert (output(bundle.denoiser) - output(theirs)).abs().max() <= TOLERANCE


def test_comfyui_applies_the_diffusers_format_file_as_trained(paths, tmp_path, one_thread):
    """ComfyUI reads a diffusers-format file without its metadata (scale 1): our file folds alpha / rank into lora_B,
    so it applies exactly there too. (ComfyUI does not map FLUX.2's time_guidance_embed in this format; the kohya
    file carries it as time_in.)"""
    bundle = adapted(paths, ALL_KOHYA[:-1], rank=4, alpha=2.0)
    file = export_diffusers_lora(tmp_path / "out", bundle.denoiser, None, bundle.family)
    tensors = read_keys(file)
    assert all(k.startswith("transformer.") and ".lora_" in k for k in tensors)
    theirs = comfy_patched_transformer(paths, tensors)
    assert (output(bundle.denoiser) - output(theirs)).abs().max() <= TOLERANCE


def test_lycoris_layers_comfyui_cannot_map_are_refused(paths, tmp_path):
    from stabletune_core.lora.export import LoraExportError

    bundle = adapted(paths, ["to_q", "time_guidance_embed.timestep_embedder.linear_1"], network="loha")
    with pytest.raises(LoraExportError) as err:
        export_kohya_lora(tmp_path / "x.safetensors", bundle.denoiser, None, bundle.family, rank=4, alpha=2.0)
    assert "has no LyCORIS name that ComfyUI reads" in str(err.value) and one_sentence(str(err.value))
    assert not (tmp_path / "x.safetensors").exists()
