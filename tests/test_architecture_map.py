"""docs/ARCHITECTURE.md, the map of the code, stays true (issue 38.5): its packages and modules are the code's, its
paths exist, and its run folder section is what runs/layout.py generates from RunPaths."""
from __future__ import annotations

import re
from pathlib import Path

from stabletune_core.runs.layout import run_folder_map

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "ARCHITECTURE.md"


def map_text() -> str:
    return MAP.read_text(encoding="utf-8")


def places_named_in_the_table(text: str) -> set[str]:
    """The first column of the packages table: `path` of each row."""
    return {match.group(1) for match in re.finditer(r"^\| `([^`]+)` \|", text, flags=re.M)}


def packages_and_top_modules() -> set[str]:
    """Every package of the engine and the UI (a folder with .py files) and every top-level module of the engine."""
    core = ROOT / "stabletune_core"
    packages = {f"{p.parent.relative_to(ROOT).as_posix()}/" for p in core.rglob("__init__.py")
                if p.parent != core}
    packages |= {"extension/", "extension/tabs/"}
    modules = {p.relative_to(ROOT).as_posix() for p in core.glob("*.py") if p.name != "__init__.py"}
    return packages | modules


def test_the_map_names_every_package_and_top_level_module_and_nothing_that_is_gone():
    named = places_named_in_the_table(map_text())
    expected = packages_and_top_modules()
    assert expected - named == set(), f"missing from docs/ARCHITECTURE.md: {sorted(expected - named)}"
    gone = [place for place in named if not (ROOT / place.rstrip("/")).exists()]
    assert not gone, f"docs/ARCHITECTURE.md names what does not exist: {gone}"


def test_every_path_the_map_names_exists():
    paths = {token for token in re.findall(r"`([\w./-]+\.(?:py|sh|md|json|toml)|[\w./-]+/)`", map_text())
             if not token.startswith("RUN/")}
    files = [f.relative_to(ROOT).as_posix() for f in ROOT.rglob("*") if ".venv" not in f.parts and ".git" not in f.parts]
    # A short name (`base.py` in a sentence about models/) is a file of some package of the repository.
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not any(f.endswith("/" + p.rstrip("/"))
                                                                             for f in files) and "NAME" not in p)
    assert not missing, missing


def test_the_run_folder_section_is_what_run_paths_generates():
    block = re.search(r"<!-- run-folder:start -->\n```\n(.*?)```\n<!-- run-folder:end -->", map_text(), re.S)
    assert block, "docs/ARCHITECTURE.md lost its run folder section"
    assert block.group(1).splitlines() == run_folder_map(), \
        "the run folder changed: paste run_folder_map()'s lines into docs/ARCHITECTURE.md"


def test_run_folder_map_follows_run_paths(monkeypatch):
    """A place added to RunPaths shows up in the generated section (so the section cannot go stale silently)."""
    from stabletune_core.runs import layout

    def receipts(self) -> Path:
        """A place added later."""
        return self.root / "receipts.json"

    monkeypatch.setattr(layout.RunPaths, "receipts", property(receipts), raising=False)
    assert "RUN/receipts.json  A place added later." in run_folder_map()


def test_the_readme_points_at_the_map():
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text(encoding="utf-8")
