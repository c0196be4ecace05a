"""What the tabs share while the UI is built: settings, the run hub, the form, and named components."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_KEY = "run"  # the run a browser follows, in its per-browser `seen` state (set by ui._live)

from .form import Form
from .session import RunHub
from .settings import UISettings


@dataclass
class UIContext:
    settings: UISettings
    hub: RunHub
    form: Form
    groups: list[str]
    # Components other tabs need, by "tab.name" (e.g. "train.message").
    parts: dict[str, Any] = field(default_factory=dict)

    def aliases(self) -> dict[str, str]:
        return {alias: f["name"] for f in self.form.fields.values() for alias in f.get("aliases", [])}

    def run_label(self, path: Path | None) -> str | None:
        """How a run appears in dropdowns: its folder name under the runs folder, else its full path."""
        if path is None:
            return None
        path = Path(path)
        return path.name if path.parent == self.settings.runs_dir else str(path)

    def run_of(self, seen: dict[str, Any] | None) -> Path | None:
        """The run one browser follows (its Train dropdown), else the hub's default."""
        run = (seen or {}).get(RUN_KEY)
        return Path(run) if run else self.hub.attach_default()

    def followed(self, label: str | None) -> Path | None:
        """The run a browser whose run dropdown shows `label` follows: that run while its folder exists, else
        (nothing chosen, or the run was deleted) the hub's default."""
        run = self.run_path(label)
        return run if run is not None and run.is_dir() else self.hub.attach_default()

    def run_path(self, label: str | None) -> Path | None:
        if not label:
            return None
        path = Path(label)
        return path if path.is_absolute() else self.settings.runs_dir / label

    def run_labels(self, current: Path | None = None) -> list[str]:
        labels = [self.run_label(r.path) for r in self.hub.runs()]
        current = current or self.hub.attached
        attached = self.run_label(current) if current is not None and Path(current).is_dir() else None
        if attached and attached not in labels:
            labels.insert(0, attached)
        return labels
