"""The built-in judges of validation images (`sample_judge`), by name. Torch-free and import-free: the config
validates the knob against this table (and the UI offers its names) without importing any judge; the training
package imports the one a run asks for (train/observers/sample_judge.py)."""
from __future__ import annotations

#: sample_judge value -> "module:Observer class" that judges each set of validation images ("none": no judge).
SAMPLE_JUDGES: dict[str, str | None] = {
    "none": None,
    "toy_colors": "stabletune_core.train.observers.sample_judge:ToyColorJudge",
}
