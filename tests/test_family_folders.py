"""Issue 39.1 / 38.4: one family, one folder, one declared face.

- Every piece one family knows lives in its folder under models/ (the family class, its single-file layout, its LoRA
  names, its memory model, its tiny builder, its shipped configs); models/ keeps only what the families share, and
  lora/ no family's names.
- No module outside the family folders and config's family rules compares a family name with a literal
  (`== "flux2_klein"`, `in ("sd1", ...)`): callers ask the family's declared face (models/base.py ModelFamily) or,
  without torch, stabletune_core/family_files.py. Nobody probes a family with getattr(..., default).
- ModelBundle's denoiser has one name: `.unet` is gone.
- No family folder imports another family's folder: what two families share lives in models/ (the memory model's
  parts in models/memory.py, what a user pointed at in models/sources.py, the Qwen3 text path in qwen3_text.py).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "stabletune_core"
MODELS = CORE / "models"
#: The names a config's model_family takes (config/families.py FAMILY_CHOICES, "auto" aside).
FAMILY_NAMES = {"sd1", "sd2", "sdxl", "flux2_klein", "z_image"}
#: The places allowed to spell family names in comparisons: the family folders and config's family rules.
ALLOWED = ("stabletune_core/models/sd/", "stabletune_core/models/flux2_klein/", "stabletune_core/models/z_image/",
           "stabletune_core/config/families.py", "stabletune_core/family_files.py")
#: Places not clean yet (none: train/ lost its last literal with set-up as phases, issue 38).
NOT_YET: list[str] = []
#: Each family folder and the pieces it holds (one file per piece, moved whole from models/ and lora/).
FOLDERS = {
    "sd": {"sd1.py", "sd2.py", "sdxl.py", "single_file.py", "sdxl_memory.py", "tiny.py", "configs"},
    "flux2_klein": {"family.py", "single_file.py", "lora.py", "memory.py", "tiny.py", "configs"},
    "z_image": {"family.py", "single_file.py", "adapter.py", "memory.py", "tiny.py", "configs"},
}
#: What models/ shares among the families (the face, the objectives, the text path, memory and loading helpers).
SHARED = {"__init__.py", "base.py", "ddpm.py", "flow_matching.py", "qwen3_text.py", "block_swap.py", "quantize.py",
          "memory.py", "memory_plan.py", "loading.py", "sources.py", "tokenizer.py", "ldm_vae.py"}


def sources(skip: tuple[str, ...]) -> dict[str, ast.AST]:
    found = {}
    for path in [*CORE.rglob("*.py"), *(ROOT / "extension").rglob("*.py")]:
        where = path.relative_to(ROOT).as_posix()
        if not where.startswith(skip):
            found[where] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def names_in(node: ast.AST) -> set[str]:
    """The family names spelled as literals in `node`: a string, or a tuple / list / set of strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & FAMILY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def literal_comparisons(trees: dict[str, ast.AST]) -> list[str]:
    """Comparisons with a family name literal on one side: `x == "sdxl"`, `family in ("sd1", "sd2")`,
    `"flux2_klein" != x`."""
    found = []
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(names_in(side) for side in [node.left, *node.comparators]):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def family_probes(trees: dict[str, ast.AST]) -> list[str]:
    return [f"{where}:{node.lineno} {ast.unparse(node)}" for where, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and node.args and
            "family" in ast.unparse(node.args[0])]


def test_no_module_outside_the_family_folders_compares_a_family_name_with_a_literal():
    found = literal_comparisons(sources(ALLOWED + tuple(NOT_YET)))
    assert not found, found


def test_the_scan_finds_a_planted_comparison():
    planted = {"planted.py": ast.parse('if family == "flux2_klein" or name in ("sd1", "sd2"):\n    pass\n'
                                       'ok = family == "auto"\n')}
    assert literal_comparisons(planted) == ["planted.py:1 family == 'flux2_klein'",
                                            "planted.py:1 name in ('sd1', 'sd2')"]
    assert family_probes({"planted.py": ast.parse('getattr(bundle.family, "lora_presets", None)')})


#: The words one family's module names go by (FLUX.2's BFL names, SDXL's SGM names, Z-Image's diffusion_model. keys,
#: the transformer families' peft names in a diffusers-format LoRA): a caller comparing them asks "which family is
#: this?" in other words.
LAYOUT_WORDS = {"bfl", "sgm", "diffusion_model", "peft"}
#: Attribute names that name a naming scheme (`family.kohya_unet_naming`, `family.diffusers_lora_key_names`).
NAMING_ATTRIBUTES = ("naming", "key_names")


def naming_comparisons(trees: dict[str, ast.AST]) -> list[str]:
    """Comparisons with a family's naming on one side: a layout word (`naming == "bfl"`, `... == "peft"`), or an
    attribute that names a naming scheme (`family.kohya_unet_naming == "..."`, `family.diffusers_lora_key_names ==
    "..."`) against any string literal."""
    found = []
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            strings = {e.value for s in sides for e in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])
                       if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            naming = any(isinstance(s, ast.Attribute) and s.attr.endswith(NAMING_ATTRIBUTES) for s in sides)
            if strings & LAYOUT_WORDS or (naming and strings):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return sorted(found)


def test_no_module_outside_the_family_folders_compares_a_naming_literal():
    """tools/lora_file.py, extract.py and merge.py asked `kohya_unet_naming == "bfl"` / `"sgm"`: they ask the face now
    (fused_lora_export, kohya_denoiser_name, denoiser_has_convolutions, single_file_merges_into_folder); and
    lora/export.py's `diffusers_lora_key_names == "peft"` (review) is the face's diffusers_lora_uses_peft_names."""
    planted = {"planted.py": ast.parse('if family.kohya_unet_naming == "bfl" or naming in ("sgm",):\n    pass\n'
                                       'x = bundle.family.kohya_unet_naming != "diffusers"\nok = fmt == "diffusers"\n'
                                       'p = family.diffusers_lora_key_names == "peft"\nq = "peft" == names\n')}
    assert naming_comparisons(planted) == ["planted.py:1 family.kohya_unet_naming == 'bfl'",
                                           "planted.py:1 naming in ('sgm',)",
                                           "planted.py:3 bundle.family.kohya_unet_naming != 'diffusers'",
                                           "planted.py:5 family.diffusers_lora_key_names == 'peft'",
                                           "planted.py:6 'peft' == names"]
    found = naming_comparisons(sources(ALLOWED))
    assert not found, found


def test_nobody_probes_a_family_with_getattr_outside_its_folder():
    found = family_probes(sources(ALLOWED))
    assert not found, found


FAMILY_HOMES = {"sd1": "sd", "sd2": "sd", "sdxl": "sd", "flux2_klein": "flux2_klein", "z_image": "z_image"}


def test_each_family_folder_holds_every_piece_of_its_family():
    from stabletune_core.models import FAMILIES, get_family

    for folder, pieces in FOLDERS.items():
        held = {p.name for p in (MODELS / folder).iterdir() if p.name != "__pycache__"}
        assert pieces | {"__init__.py"} <= held, (folder, sorted(pieces - held))
    homes = {name: Path(inspect.getsourcefile(type(get_family(name)))).parent.relative_to(MODELS).as_posix()
             for name in FAMILIES}
    assert homes == FAMILY_HOMES
    flat = {p.name for p in MODELS.iterdir() if p.is_file()}
    assert flat == SHARED, sorted(flat ^ SHARED)  # nothing of one family left beside the shared pieces
    assert {p.name for p in MODELS.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FOLDERS)
    lora = {p.stem for p in (CORE / "lora").glob("*.py")}
    assert not lora & {"flux2", "sdxl", "sd1", "z_image", "klein"}, lora  # a family's LoRA names live in its folder


def family_folder_imports(folders: dict[str, Path]) -> list[tuple[str, str]]:
    """(file, imported module) for every import in a family folder of another family's folder: relative
    (`from ..flux2_klein.family import x`, `from .. import sd`) or absolute (`stabletune_core.models.sd...`)."""
    found = []
    for folder, where in folders.items():
        for path in sorted(where.rglob("*.py")):
            package = ["stabletune_core", "models", folder, *path.relative_to(where).parent.parts]
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
                    head = ".".join(p for p in (base, node.module or "") if p)
                    modules = [head, *(f"{head}.{alias.name}" for alias in node.names)]
                else:
                    continue
                for other in folders:
                    hit = next((m for m in modules if other != folder and
                                (m == f"stabletune_core.models.{other}" or
                                 m.startswith(f"stabletune_core.models.{other}."))), None)
                    if hit:
                        found.append((f"stabletune_core/models/{folder}/{path.relative_to(where).as_posix()}", hit))
    return found


def test_no_family_folder_imports_another(tmp_path):
    """What two families share lives in models/ (the Qwen3 text path and its tiny model in qwen3_text.py, the LDM
    VAE layout in ldm_vae.py, check_source and safetensors_header in sources.py, the memory model's generic
    pieces in memory.py, LoRA target resolution in
    lora/targets.py): Z-Image took Klein's tokenizer check, targets, header reader and tiny Qwen3, and Klein and
    Z-Image took SD's check_source (and Klein SD's VAE tables)."""
    planted = tmp_path / "z_image"
    planted.mkdir()
    (planted / "family.py").write_text("from ..flux2_klein.family import check_tokenizer\nfrom .. import sd\n"
                                       "import stabletune_core.models.sd.sd1\nfrom ..qwen3_text import x\n"
                                       "from .tiny import y\n")
    (tmp_path / "sd").mkdir()
    (tmp_path / "flux2_klein").mkdir()
    assert [m for _, m in family_folder_imports({name: tmp_path / name for name in ("sd", "flux2_klein", "z_image")})
            ] == ["stabletune_core.models.flux2_klein.family", "stabletune_core.models.sd",
                  "stabletune_core.models.sd.sd1"]
    found = set(family_folder_imports({name: MODELS / name for name in FOLDERS}))
    assert not found, sorted(found)


def test_the_family_folders_import_without_loading_a_family_they_do_not_name():
    """A family folder's __init__ is a table of contents, not an import of its pieces."""
    for folder in FOLDERS:
        tree = ast.parse((MODELS / folder / "__init__.py").read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], folder


def test_the_bundles_denoiser_has_one_name():
    from stabletune_core.models.base import ModelBundle

    assert not hasattr(ModelBundle, "unet")
    bundle = ModelBundle(family=None, denoiser=object(), vae=None, text_encoders=[], tokenizers=[],
                         noise_scheduler=None, source="x")
    with pytest.raises(AttributeError):
        bundle.unet  # noqa: B018
    uses = [f"{p.relative_to(ROOT)}:{i}" for p in [*CORE.rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                                                  *(ROOT / "bench").glob("*.py")]
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "bundle.unet" in line
            and p.name != Path(__file__).name]
    assert not uses, uses


def test_the_tools_tell_every_familys_lora_file_by_what_the_family_declares():
    """tools/lora_file.py has no table of family names: a LoRA file's metadata (as each family writes it) and the
    module names only one family uses name that family, Z-Image's included."""
    from stabletune_core.models import FAMILIES, get_family
    from stabletune_core.tools.lora_file import family_of_metadata, family_of_names

    for name in FAMILIES:
        family = get_family(name)
        assert family_of_metadata({"ss_base_model_version": family.base_model_version}) == name
        assert family_of_metadata({"modelspec.architecture": family.modelspec_architecture}) == name
        for prefix in family.lora_module_prefixes:
            assert family_of_names([prefix + "x.lora_down.weight"]) == name
    assert family_of_names(["lora_unet_down_blocks_0_attentions_0_proj_in"]) is None  # SD 1.x and 2.x share it
    assert family_of_metadata({}) is None


#: Where a family's file markers may be spelled: the rule itself and the engine's converters in the family folders.
RULE_HOMES = ("stabletune_core/family_files.py", "stabletune_core/models/")


def rule_copies(trees: dict[str, ast.AST]) -> list[str]:
    """String constants equal to one of family_files.py's detection markers, or a TRANSFORMER_FAMILIES assigned: a
    second copy of a rule (or of the UI's table) that can drift from the engine's."""
    from stabletune_core import family_files as ff

    markers = {*ff.Z_IMAGE_MARKERS, *ff.Z_IMAGE_DIFFUSERS_MARKERS, ff.FLUX2_MODULATION_KEY, ff.FLUX2_DEV_GUIDANCE_KEY,
               ff.KLEIN_PIPELINE_PREFIX, ff.Z_IMAGE_PIPELINE}
    found = []
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in markers:
                found.append(f"{where}:{node.lineno} {node.value!r}")
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and "TRANSFORMER_FAMILIES" in {
                    ast.unparse(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])}:
                found.append(f"{where}:{node.lineno} TRANSFORMER_FAMILIES =")
    return found


def test_each_familys_file_rule_and_the_uis_family_table_are_declared_once():
    """The Klein and Z-Image file rules live in family_files.py, which the engine's detection and the UI both call;
    the UI's table of transformer families too (issue 39: zimage's extension/validation.py had its own copies)."""
    from stabletune_core import family_files
    from stabletune_core.models.z_image import family, single_file

    assert not rule_copies(sources(RULE_HOMES)), rule_copies(sources(RULE_HOMES))
    assert rule_copies({"planted.py": ast.parse('TRANSFORMER_FAMILIES = {}\nz = "cap_embedder.1.weight" in keys')})
    assert single_file.file_layout is family_files.z_image_file_layout
    assert "files_name_z_image" in inspect.getsource(family.looks_like_z_image)


def test_the_toy_build_is_the_toy_bases_own(monkeypatch):
    """`toy build --family X` calls the build its ToyBase declares (toy/bases.py), with only the steps given."""
    from stabletune_core.toy import __main__ as toy_main, build, klein_build

    calls = []
    monkeypatch.setattr(klein_build, "build", lambda out, **kw: calls.append(("klein", out, sorted(kw))))
    monkeypatch.setattr(build, "build", lambda out, **kw: calls.append(("sd1", out, sorted(kw))))
    assert toy_main.main(["build", "--family", "flux2_klein", "--out", "k", "--unet-steps", "7"]) == 0
    assert toy_main.main(["build", "--family", "sd1", "--vae-steps", "5"]) == 0
    assert calls == [("klein", Path("k"), ["log", "transformer_steps"]),
                     ("sd1", build.default_out(), ["log", "vae_polish_steps", "vae_steps"])]


def calls_to(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]


def constants_containing(tree: ast.AST, text: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and text in n.value]


def test_twins_the_families_shared_are_written_once():
    """`duplicates` twins merged: SD's tiny builders seeded each part by hand (SD 1.x/2.x and SDXL, seven
    torch.manual_seed calls), now one `_seeded` helper; SD's and FLUX.2's single files each spelled the LDM VAE's
    key rule (the mid-block attention's renames), now models/ldm_vae.py's `ldm_vae_key`."""
    tiny = ast.parse((MODELS / "sd" / "tiny.py").read_text(encoding="utf-8"))
    seeding = [n.name for n in ast.walk(tiny) if isinstance(n, ast.FunctionDef) and calls_to(n, "torch.manual_seed")]
    assert seeding == ["_seeded"] and len(calls_to(tiny, "torch.manual_seed")) == 1, seeding
    rule = {p.relative_to(MODELS).as_posix(): constants_containing(ast.parse(p.read_text(encoding="utf-8")),
                                                                    "mid.attn_1.")
            for p in MODELS.rglob("*.py")}
    assert {where for where, lines in rule.items() if lines} == {"ldm_vae.py"}, rule


def test_the_plan_asks_each_familys_own_memory_model():
    from stabletune_core.models.memory_plan import FAMILY_MEMORY_MODELS

    for name, memory_model in FAMILY_MEMORY_MODELS.items():
        assert memory_model().swappable_blocks.__module__.split(".")[2] == FAMILY_HOMES[name], name
