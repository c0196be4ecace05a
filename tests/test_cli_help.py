"""`--help` of every command works and lists every knob (a '%' in a knob's doc once broke `train --help`)."""
from __future__ import annotations

import pytest

from stabletune_core import cli
from stabletune_core.config import TrainConfig


@pytest.mark.parametrize("command", ["train", "demo", "preflight", "export", "resize"])
def test_help_prints_and_exits_zero(command, capsys):
    assert cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "usage:" in text
    if command == "train":
        missing = [name for name in TrainConfig.model_fields if f"--{name}" not in text]
        assert not missing, missing
        assert "20-30% slower" in " ".join(text.split())  # percent signs print as written
