"""Issue 37.3, 37.8, 37.18 and the remark below its list: `extract --conv_rank` takes the ResNets' every layer,
`merge --energy` alone is not capped at the largest input rank, every number a tool takes is checked the way the
training flags are (NaN, inf, 0, negative, huge) in one sentence, two inputs sharing a file name are told apart,
`inspect` says what a non-LoRA file is, and a tool's internal-error traceback lands in a bounded folder it names."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import save_file

from flux2_tools import one_sentence
from stabletune_core.cli import main
from stabletune_core.tools.merge import merge_loras, parse_weighted
from tests.test_tools_merge import bases, deltas, merge_then_extract, trained_lora  # noqa: F401  (bases: a fixture)

RESNET = ["conv1", "conv2", "time_emb_proj", "conv_shortcut"]


def test_extract_with_conv_rank_takes_every_resnet_layer(bases, tmp_path, one_thread):
    folder, single = bases["sd1"]
    _, lora = trained_lora("sd1", "lora", tmp_path / "resnet.safetensors", seed=7, targets=["to_q", *RESNET])
    want = deltas(lora)
    assert any("time_emb_proj" in n for n in want) and any("conv_shortcut" in n for n in want)
    extracted = merge_then_extract(single, folder, lora, tmp_path)
    got = deltas(extracted)
    missing = sorted(set(want) - set(got))
    assert not missing, f"left out: {missing}"
    energy = lambda d: sum(float(v.pow(2).sum()) for v in d.values())  # noqa: E731
    assert energy({n: got[n] for n in want}) == pytest.approx(energy(want), rel=1e-4)  # none of the update lost


def test_merge_energy_alone_keeps_what_it_asks(tmp_path):
    _, a = trained_lora("sd1", "lora", tmp_path / "a.safetensors", seed=5)
    _, b = trained_lora("sd1", "lora", tmp_path / "b.safetensors", seed=6)
    out = tmp_path / "ab.safetensors"
    note, report = merge_loras([(a, 0.5), (b, 0.5)], out, energy=0.999)
    kept = sorted(m.energy_kept for m in report)
    assert kept[0] >= 0.999, f"{sum(k < 0.999 for k in kept)} of {len(kept)} modules keep less, the worst {kept[0]:.1%}"
    assert max(m.new_rank for m in report) > 2  # beyond the largest input rank (2) where the sum needs it
    assert "at most rank" not in note


BAD_WEIGHTS = ["nan", "inf", "-inf", "0", "1e9"]


@pytest.mark.parametrize("weight", BAD_WEIGHTS)
def test_merge_refuses_a_weight_that_is_no_weight(weight, tmp_path, capsys):
    _, a = trained_lora("sd1", "lora", tmp_path / "a.safetensors", seed=5)
    out = tmp_path / "out.safetensors"
    assert main(["merge", "--lora", f"{a}:{weight}", str(a), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and "weight" in err and "internal error" not in err and not out.exists()


@pytest.mark.parametrize("flags", [["--rank", "0"], ["--rank", "-4"], ["--rank", "1000000000"],
                                   ["--energy", "nan"], ["--energy", "inf"], ["--energy", "0"], ["--energy", "-1"],
                                   ["--energy", "1e300"]])
def test_merge_numbers_are_checked_in_one_sentence(flags, tmp_path, capsys):
    _, a = trained_lora("sd1", "lora", tmp_path / "a.safetensors", seed=5)
    _, b = trained_lora("sd1", "lora", tmp_path / "b.safetensors", seed=6)
    out = tmp_path / "out.safetensors"
    assert main(["merge", "--lora", str(a), str(b), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and flags[0] in err and "internal error" not in err and not out.exists()


@pytest.mark.parametrize("flags", [["--rank", "0"], ["--rank", "-1"], ["--energy", "nan"], ["--energy", "inf"],
                                   ["--energy", "0"], ["--conv_rank", "-1"], ["--min_diff", "nan"],
                                   ["--min_diff", "-1"], ["--min_diff", "inf"]])
def test_extract_numbers_are_checked_in_one_sentence(flags, bases, tmp_path, capsys):
    folder, _ = bases["sd1"]
    out = tmp_path / "x.safetensors"
    assert main(["extract", "--base", str(folder), "--tuned", str(folder), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and flags[0] in err and "internal error" not in err and not out.exists()


@pytest.mark.parametrize("flags", [["--resolution", "0"], ["--resolution", "-512"], ["--resolution", "999999936"],
                                   ["--near_distance", "-1"], ["--near_distance", "100000"], ["--top", "0"],
                                   ["--top", "-5"]])
def test_doctor_numbers_are_checked_in_one_sentence(flags, tmp_path, capsys):
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), (200, 0, 0)).save(data / "a.png")
    assert main(["doctor", str(data), *flags]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and flags[0].strip("-") in err and "internal error" not in err


def test_two_inputs_of_one_name_are_told_apart(tmp_path, capsys):
    (tmp_path / "style").mkdir()
    (tmp_path / "face").mkdir()
    _, a = trained_lora("sd1", "lora", tmp_path / "style" / "mine.safetensors", seed=5)
    _, b = trained_lora("sd1", "lora", tmp_path / "face" / "mine.safetensors", seed=6)
    capsys.readouterr()
    assert main(["merge", "--lora", f"{a}:0.7", f"{b}:0.3", "--output", str(tmp_path / "ab.safetensors")]) == 0
    said = capsys.readouterr().out
    assert "style/mine.safetensors x0.7" in said and "face/mine.safetensors x0.3" in said
    assert [w for _, w in parse_weighted([f"{a}:0.7", str(b)])] == [0.7, 1.0]


def test_inspect_says_what_a_text_encoder_file_is(tmp_path, capsys):
    from stabletune_core.models.sd import tiny

    encoder = tiny.build_tiny_components(0)["text_encoder"]
    path = tmp_path / "clip_l.safetensors"
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(path))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and "CLIP text encoder" in err and "not a LoRA" in err and "LoRA modules" not in err


def test_tool_tracebacks_are_kept_in_the_cache_and_bounded(tmp_path, monkeypatch, capsys):
    from stabletune_core.train import outcome

    monkeypatch.setenv("STABLETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(outcome, "TRACEBACKS_KEPT", 3)
    folder = tmp_path / "cache" / "tracebacks"
    for n in range(5):
        try:
            raise RuntimeError(f"bug {n}")
        except RuntimeError as exc:
            assert outcome.report_failure(exc, None) != 0
        line = capsys.readouterr().err.strip()
        where = Path(line.rsplit("the traceback is in ", 1)[1].rstrip("."))
        assert where.parent == folder and f"bug {n}" in where.read_text()
        os.utime(where, ns=(n * 10**9, n * 10**9))  # one a second: the newest are the last ones written
    kept = sorted(folder.iterdir())
    assert len(kept) == 3 and all(f"bug {n}" in p.read_text() for n, p in zip((2, 3, 4), kept))


def test_files_a_user_can_name_are_one_sentence_not_an_internal_error(tmp_path, capsys):
    """Each of these ended in `internal error` (merge/extract: SafetensorError; doctor: UnicodeDecodeError,
    IsADirectoryError, FileNotFoundError) or printed an empty run for a folder that is none (inspect)."""
    from PIL import Image

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(bytes(range(256)) * 4)
    folder = tmp_path / "not-a-run"
    folder.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), (200, 0, 0)).save(data / "a.png")
    _, lora = trained_lora("sd1", "lora", tmp_path / "a.safetensors", seed=5)
    capsys.readouterr()
    commands = [["inspect", str(folder)],
                ["merge", "--model", str(junk), "--lora", str(lora), "--output", str(tmp_path / "m.safetensors")],
                ["extract", "--base", str(junk), "--tuned", str(junk), "--output", str(tmp_path / "e.safetensors")],
                ["doctor", str(data), "--config", str(junk)],
                ["doctor", str(data), "--json", str(folder)],
                ["doctor", str(data), "--json", str(tmp_path / "missing" / "report.json")]]
    for command in commands:
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().removeprefix("error: ")
        assert one_sentence(err) and "internal error" not in err, (command, err)


@pytest.mark.parametrize("flags", [["--batch_size", "0"], ["--batch_size", "100000000"], ["--max_new_tokens", "0"],
                                   ["--max_new_tokens", "-5"], ["--max_new_tokens", "10000000"],
                                   ["--num_beams", "0"], ["--num_beams", "100000"], ["--threshold", "nan"],
                                   ["--character_threshold", "inf"]])
def test_caption_numbers_are_checked_in_one_sentence(flags, tmp_path, capsys):
    from tests.tools_helpers import build_wd14_tagger

    data = tmp_path / "data"
    data.mkdir()
    tagger = build_wd14_tagger(tmp_path / "tagger")
    assert main(["caption", str(data), "--model", str(tagger), *flags]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and flags[0] in err and "internal error" not in err


def test_a_missing_captioning_model_is_worded_for_the_ui_too(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    assert main(["caption", str(data), "--model", str(tmp_path / "no-such-tagger")]) == 2
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert one_sentence(err) and "as the captioning model (--model)" in err and "point --model" not in err
