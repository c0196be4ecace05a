"""Issue 37.1: where a FLUX.2 Klein adapter file loads, declared once (config/hosts.py), proven here and in the README.

For every adapter kind StableTune trains on Klein (LoRA, DoRA, LoHa, LoKr; and LoKr on the top-level modules), the
file we write is loaded by diffusers' real Flux2KleinPipeline.load_lora_weights (installed) and by ComfyUI's rules
(re-stated in tests/test_flux2_lora.py from comfy/lora.py, comfy/utils.py and comfy/weight_adapter). Where the
declared matrix says a host loads the kind, the loaded model must compute what the trained one does (to 1e-5); where
it says the host does not, that must be true (the loader refuses, or the loaded model does not compute ours). The
README's host table must say the same as the matrix.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from test_flux2_lora import (TOLERANCE, adapted, comfy_patched_transformer, fresh_pipeline, output,  # noqa: F401
                             paths, read_keys)
from stabletune_core.config.hosts import KLEIN_SUPPORT, TOP_LEVEL, adapter_kind, klein_host_limits
from stabletune_core.lora.export import export_kohya_lora
from stabletune_core.models.flux2_klein.family import LORA_PRESETS

README = Path(__file__).resolve().parent.parent / "README.md"
CASES = [("lora", "lora", LORA_PRESETS["attention"]), ("dora", "dora", LORA_PRESETS["attention_mlp"]),
         ("loha", "loha", LORA_PRESETS["attention_mlp"]), ("lokr", "lokr", LORA_PRESETS["attention_mlp"]),
         ("lokr-top-level", "lokr", LORA_PRESETS["attention"] + list(TOP_LEVEL))]


def declared_loads(kind: str, targets: list[str], host: str) -> bool:
    return not any(f"does not load in {host}" in limit for limit in klein_host_limits(kind))


def written_file(paths, kind, targets, tmp_path):
    bundle = adapted(paths, targets, network=kind, rank=4, alpha=2.0)
    file = export_kohya_lora(tmp_path / f"{kind}.safetensors", bundle.denoiser, None, bundle.family, rank=4, alpha=2.0,
                             dtype=torch.float32)
    return bundle, file


def diffusers_computes_ours(paths, bundle, file) -> bool:
    pipe = fresh_pipeline(paths)
    try:
        pipe.load_lora_weights(str(file))
    except (ValueError, KeyError, RuntimeError):  # "Invalid adapter checkpoint", unrecognised keys
        return False
    return float((output(bundle.denoiser) - output(pipe.transformer)).abs().max()) <= TOLERANCE


def comfyui_computes_ours(paths, bundle, file) -> bool:
    try:
        theirs = comfy_patched_transformer(paths, read_keys(file))
    except AssertionError:  # a module ComfyUI would not map
        return False
    return float((output(bundle.denoiser) - output(theirs)).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("case, kind, targets", CASES, ids=[c[0] for c in CASES])
def test_each_kind_loads_where_the_matrix_says_and_only_there(case, kind, targets, paths, tmp_path, one_thread):
    bundle, file = written_file(paths, kind, targets, tmp_path)
    assert (output(bundle.denoiser) - output(fresh_pipeline(paths).transformer)).abs().max() > 100 * TOLERANCE  # it acts
    assert diffusers_computes_ours(paths, bundle, file) == declared_loads(kind, targets, "diffusers"), case
    assert comfyui_computes_ours(paths, bundle, file) == declared_loads(kind, targets, "ComfyUI"), case


def readme_klein_rows() -> dict[str, dict[str, str]]:
    """{kind: {column: cell}} of the README host table's FLUX.2 Klein rows."""
    lines = [line for line in README.read_text().splitlines() if line.strip().startswith("|")]
    header = next([cell.strip() for cell in line.split("|")] for line in lines
                  if line.split("|")[1].strip() == "LoRA of")  # the host table's header row
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")]
        if cells[1].startswith("FLUX.2 Klein"):
            kind = re.search(r"\b(LoRA|DoRA|LoHa|LoKr)\b", cells[1])[1].lower()
            rows[kind] = dict(zip(header, cells))
    return rows


def test_the_readme_host_table_says_what_the_matrix_says():
    rows = readme_klein_rows()
    assert set(rows) == set(KLEIN_SUPPORT), rows.keys()
    for kind, support in KLEIN_SUPPORT.items():
        row = rows[kind]
        for host, reason in support.items():
            column = next(c for c in row if c.startswith(host.split()[0]))
            assert row[column].startswith("yes" if reason is None else "no"), (kind, host, row[column])
        if kind != "lora":  # the ComfyUI builds that first load every layer of a LyCORIS-named file
            assert "PR #11997" in row[next(c for c in row if c.startswith("ComfyUI"))], kind
    lokr_diffusers = rows["lokr"][next(c for c in rows["lokr"] if c.startswith("diffusers"))]
    assert all(name in lokr_diffusers for name in TOP_LEVEL)  # the top-level targets load too
    assert declared_loads("lokr", list(TOP_LEVEL), "diffusers")


def test_the_limits_reach_the_ui_and_the_console_before_start():
    from stabletune_core.config import build_config

    notes = build_config(dict(model_family="flux2_klein", use_dora=True)).notes()
    assert any("does not load in diffusers" in n and "0.42.1" in n for n in notes), notes
    assert adapter_kind("lora", True) == "dora"
    assert not [n for n in build_config(dict(model_family="flux2_klein")).notes() if "does not load" in n]
    assert not [n for n in build_config(dict(use_dora=True)).notes() if "does not load" in n]  # SD: its own row


def test_a_klein_loha_run_says_where_its_file_does_not_load_in_its_last_lines(paths, shapes_dataset, tmp_path):
    from test_flux2_training import cli, small_args

    run = tmp_path / "run"
    done = cli(*small_args(paths["folder"], shapes_dataset, run, network_type="loha", max_train_steps=1))
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-3:]
    assert last[0].startswith("LoRA written to"), done.stdout[-2000:]
    assert any(line.startswith("host: This LoHa file does not load in diffusers") and "0.42.1" in line
               for line in last), last
    assert any(line.startswith("host: This LoHa file loads in ComfyUI") and "PR #11997" in line for line in last), last


def test_a_klein_lokr_on_top_level_modules_is_one_module_per_layer_for_inspect(paths, tmp_path, capsys):
    """The LoKr's module names are dotted paths (transformer.<path>): inspect and the tools count one per layer."""
    from stabletune_core.cli import main
    from stabletune_core.tools.lora_file import read_adapter

    targets = LORA_PRESETS["attention"] + list(TOP_LEVEL)
    _, file = written_file(paths, "lokr", targets, tmp_path)
    assert all(k.startswith("transformer.") and ".alpha" not in k for k in read_keys(file))  # alpha folded in
    assert main(["inspect", str(file)]) == 0
    assert f": {len(read_keys(file))} tensors, 23 LoRA modules" in capsys.readouterr().out  # 20 + 3 top-level
    modules, _ = read_adapter(file)
    assert len(modules) == 23 and "transformer.x_embedder" in modules


def test_the_ui_check_names_the_limit_for_a_detected_klein_before_start(paths, shapes_dataset, tmp_path):
    """Check settings / Start in the UI: model_family auto on a Klein folder, LoHa: the note says where it does not
    load (the UI reads it through the engine's config, extension/validation.py)."""
    import sys

    from extension.validation import validate

    values = dict(pretrained_model_name_or_path=str(paths["folder"]), train_data_dir=str(shapes_dataset),
                  output_dir=str(tmp_path / "run"), network_type="loha", resolution=64)
    problems, notes = validate(values, sys.executable)
    assert any(n.startswith("This LoHa file does not load in diffusers") for n in notes), (problems, notes)
    assert any("PR #11997" in n for n in notes)


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_comfyui_builds_before_its_prs_skip_exactly_the_layers_hosts_py_names(kind, paths, tmp_path):
    """The version claim of config/hosts.py against ComfyUI's key table (tests/test_flux2_lora.py comfy_key_map):
    without PR #11997 only the MLP layers of an attention+MLP file go unmapped, without PR #11981 also the single
    blocks'; a plain LoRA (BFL names) maps in full either way."""
    from test_flux2_lora import comfy_base, comfy_key_map, comfy_module_names

    from stabletune_core.config.hosts import COMFYUI_LYCORIS_SINCE

    base, bfl = comfy_base(paths)
    _, file = written_file(paths, kind, LORA_PRESETS["attention_mlp"], tmp_path)
    names = comfy_module_names(read_keys(file))
    skipped = {pr: names - comfy_key_map(bfl, base.inner_dim, before_pr=pr).keys() for pr in (11981, 11997)}
    assert not names - comfy_key_map(bfl, base.inner_dim).keys()
    assert skipped[11997] and all(re.search(r"ff(_context)?[._]linear_(in|out)$", n) for n in skipped[11997])
    singles = skipped[11981] - skipped[11997]
    assert singles and all("single_transformer_blocks" in n for n in singles)
    assert "PR #11997" in COMFYUI_LYCORIS_SINCE and "PR #11981" in COMFYUI_LYCORIS_SINCE
    _, lora = written_file(paths, "lora", LORA_PRESETS["attention_mlp"], tmp_path)
    assert not comfy_module_names(read_keys(lora)) - comfy_key_map(bfl, base.inner_dim, before_pr=11981).keys()
