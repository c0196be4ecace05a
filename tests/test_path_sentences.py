"""Issue 37: a sentence about a folder or file names its path once, stays one sentence and under ~300 characters
besides the path. Each case was a sentence that named a path twice (a folder and the run folder inside it; the
checkpoint both in the export's / resume's words and in the reason) or ran on as two sentences."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from stabletune_core.config import build_config
from stabletune_core.config.world import check_inputs


def world_sentence(tmp_path: Path, case: str) -> str:
    data = tmp_path / "data"
    data.mkdir()
    values = dict(train_data_dir=str(data), output_dir=str(data / "runs" / "a"))
    if case == "output-in-reg":
        (tmp_path / "class").mkdir()
        values.update(reg_data_dir=str(tmp_path / "class"), output_dir=str(tmp_path / "class" / "run"))
    elif case == "output-under-a-file":
        (tmp_path / "notes.txt").write_text("mine")
        values.update(output_dir=str(tmp_path / "notes.txt" / "run"))
    words = {"output-in-dataset": "inside the dataset folder", "output-in-reg": "inside the regularisation folder",
             "output-under-a-file": "cannot be created"}[case]
    return next(p for p in check_inputs(build_config(values), need_model=False) if words in p)


def checkpoint_without_manifest(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    folder = run / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    (run / "config.toml").write_text("")
    return folder


def resume_sentence(tmp_path: Path, case: str) -> str:
    from stabletune_core.train.outcome import RunFailed
    from stabletune_core.train.setup import find_resume_checkpoint

    config = build_config(dict(output_dir=str(tmp_path / "other"),
                               resume_from_checkpoint=str(checkpoint_without_manifest(tmp_path))))
    with pytest.raises(RunFailed) as failed:
        find_resume_checkpoint(config, report=lambda message: None)
    return str(failed.value)


def export_sentence(tmp_path: Path, case: str, capsys) -> str:
    from stabletune_core.cli import main

    assert main(["export", str(checkpoint_without_manifest(tmp_path))]) == 2
    return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))[7:]


@pytest.mark.parametrize("case", ["output-in-dataset", "output-in-reg", "output-under-a-file", "resume-corrupt",
                                  "export-corrupt"])
def test_the_sentence_names_its_path_once(case, tmp_path, capsys):
    if case == "resume-corrupt":
        sentence = resume_sentence(tmp_path, case)
    elif case == "export-corrupt":
        sentence = export_sentence(tmp_path, case, capsys)
    else:
        sentence = world_sentence(tmp_path, case)
    assert sentence.count(tmp_path.name) == 1, sentence  # every path of the case lies in tmp_path
    besides = re.sub(r"\S*" + re.escape(tmp_path.name) + r"\S*", "PATH", sentence)
    assert len(besides) < 300 and not re.search(r"\.\s+[A-Z]", besides), sentence  # one sentence, not two
