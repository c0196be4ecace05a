"""The pure helpers of bench/toy_quality.py: the peer's copy of the dataset, the budget bookkeeping, and the
command lines of each family's rows (the Klein example's built without the example)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parent.parent


bench = load_bench("toy_quality")


def stabletune_dataset(root: Path) -> Path:
    """Two kohya-style sub-folders whose files share a name, as the concept and prior folders can."""
    for folder, caption in (("1_purple", "a purple circle"), ("1_known_colours", "a red circle")):
        (root / folder).mkdir(parents=True)
        Image.new("RGB", (8, 8), "white").save(root / folder / "shape_000.png")
        (root / folder / "shape_000.txt").write_text(caption + "\n")
    return root


def test_imagefolder_has_every_image_with_its_own_caption(tmp_path):
    images = bench.dataset_images(stabletune_dataset(tmp_path / "data"))
    target = bench.write_imagefolder(images, tmp_path / "peer")
    rows = [json.loads(line) for line in (target / "metadata.jsonl").read_text().splitlines()]
    assert sorted(r["text"] for r in rows) == ["a purple circle", "a red circle"]  # priors included, no newline
    assert len({r["file_name"] for r in rows}) == 2  # same file name in two folders: no collision
    for row in rows:
        assert (target / row["file_name"]).is_file()
        folder = row["file_name"].split("__")[0]
        assert row["text"] == (tmp_path / "data" / folder / "shape_000.txt").read_text().strip()


def test_imagefolder_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "peer").mkdir()
    (tmp_path / "peer" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        bench.write_imagefolder([], tmp_path / "peer")
    assert (tmp_path / "peer" / "mine.txt").read_text() == "keep"


def test_budget_takes_the_furthest_snapshot_written_within_it():
    snaps = [bench.Snapshot(10, 8.0, Path("a")), bench.Snapshot(20, 59.9, Path("b")),
             bench.Snapshot(30, 60.1, Path("c"))]
    assert bench.snapshot_within(snaps, 60).step == 20
    assert bench.snapshot_within(snaps, 120).step == 30
    assert bench.snapshot_within(snaps, 5) is None


def test_snapshot_time_is_its_last_written_file(tmp_path):
    started = 1_000_000.0
    for step, times in ((10, (started + 3, started + 7)), (20, (started + 9, started + 12))):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for i, when in enumerate(times):
            (folder / f"f{i}").write_text("x")
            os.utime(folder / f"f{i}", (when, when))
    (tmp_path / "checkpoint-30").mkdir()  # empty: still being written, not a snapshot yet
    (tmp_path / "logs").mkdir()
    found = bench.snapshots(tmp_path, r"checkpoint-(\d+)", started)
    assert [(s.step, s.seconds) for s in found] == [(10, 7.0), (20, 12.0)]


def test_budgets_are_minutes_sorted_and_positive():
    assert bench.parse_budgets("4,1,2") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1"):
        with pytest.raises(SystemExit):
            bench.parse_budgets(bad)


# ------------------------------------------------------------------------------------- --family flux2_klein
def flags_of(command: list[str]) -> dict[str, list[str]]:
    """{--flag: [values]} of a command line (the words before the first flag are left out)."""
    flags: dict[str, list[str]] = {}
    current: list[str] = []
    for word in command:
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        elif flags:
            current.append(word)
    return flags


def klein_preset() -> dict:
    from stabletune_core.config import read_toml

    return read_toml(bench.default_preset("flux2_klein"))


def test_each_family_runs_its_own_demo_preset_by_default(tmp_path):
    from stabletune_core.config.flags import add_config_arguments, config_from_args

    assert bench.default_preset("sd1") == bench.PRESET == ROOT / "presets" / "demo.toml"
    klein = bench.default_preset("flux2_klein")
    assert klein == ROOT / "presets" / "demo-flux2-klein.toml"
    command = bench.stabletune_command(tmp_path / "model", tmp_path / "data", tmp_path / "run", 15, klein)
    assert command[1:4] == ["-m", "stabletune_core", "train"]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(command[4:]))  # what StableTune's own parser makes of it
    assert config.model_family == "flux2_klein" and config.save_steps == 15
    assert config.learning_rate == klein_preset()["learning_rate"]  # the preset's knobs, not the bench's


def test_klein_rows_are_the_readme_recipe_and_the_same_at_stabletunes_lr_rank_and_batch(tmp_path):
    preset = klein_preset()
    rows = bench.peer_rows("flux2_klein", preset)
    assert len(rows) == 2
    commands = [bench.family_peer_command("flux2_klein", tmp_path / "train.py", tmp_path / "model",
                                          tmp_path / "peer-data", tmp_path / f"run{i}", 20, preset, row)
                for i, (_, row) in enumerate(rows)]
    readme, ours = (flags_of(c) for c in commands)
    for command, flags in zip(commands, (readme, ours)):
        assert command[:2] == [sys.executable, str(tmp_path / "train.py")]
        # what the toy base and the bench fix for every row: data, resolution, seed, text length and layers, saves
        assert flags["--dataset_name"] == [str(tmp_path / "peer-data")] and flags["--caption_column"] == ["text"]
        assert flags["--resolution"] == [str(preset["resolution"])] and flags["--seed"] == [str(preset["seed"])]
        assert flags["--max_sequence_length"] == [str(preset["max_sequence_length"])] == ["32"]
        assert flags["--text_encoder_out_layers"] == ["9", "18", "27"]
        assert flags["--checkpointing_steps"] == ["20"] and flags["--max_train_steps"] == ["500"]
    # (a) examples/dreambooth/README_flux2.md's Klein recipe, the script's defaults for rank, alpha and batch
    assert (readme["--learning_rate"], readme["--rank"], readme["--lora_alpha"], readme["--train_batch_size"]) == \
        (["0.0001"], ["4"], ["4"], ["4"])
    # (b) StableTune's learning rate, rank, alpha and batch
    alpha = preset.get("lora_alpha") or preset["lora_rank"]
    assert (float(ours["--learning_rate"][0]), ours["--rank"], ours["--lora_alpha"], ours["--train_batch_size"]) == \
        (preset["learning_rate"], [str(preset["lora_rank"])], [str(int(alpha))], [str(preset["train_batch_size"])])
    assert "lr 0.0001, rank 4" in rows[0][0] and f"lr {preset['learning_rate']:g}" in rows[1][0]


def test_sd1_rows_are_unchanged_by_the_klein_family(tmp_path):
    from stabletune_core.config import read_toml

    preset = read_toml(bench.PRESET)
    rows = bench.peer_rows("sd1", preset)
    assert [name for name, _ in rows] == ["diffusers example, lr 0.0001", "diffusers example, lr 0.001"]
    for name, row in rows:
        assert bench.family_peer_command("sd1", Path("t.py"), Path("m"), Path("d"), Path("o"), 10, preset, row) == \
            bench.peer_command(Path("t.py"), Path("m"), Path("d"), Path("o"), row["learning_rate"], 10, preset)


def test_a_fractional_alpha_is_one_sentence():
    with pytest.raises(SystemExit, match="whole number"):
        bench.peer_rows("flux2_klein", {**klein_preset(), "lora_alpha": 4.5})


def test_scoring_takes_the_longest_budget_first_across_rows(tmp_path):
    """A run stopped while scoring (scoring is the slow part on a busy CPU) has the comparable cells first; a cell
    without a snapshot is not scored, and results.json holds no run-only objects."""
    snap = bench.Snapshot(10, 5.0, tmp_path)
    rows = [{"name": "a", "chosen": [None, snap, snap], "env": {"X": "1"}},
            {"name": "b", "chosen": [snap, None, snap], "env": {}}]
    order = [(b, row["name"]) for b, row in bench.scoring_order(rows, 3)]
    assert order == [(2, "a"), (2, "b"), (1, "a"), (0, "b")]
    bench.write_results(tmp_path / "results.json", {"complete": False, "rows": rows})
    written = json.loads((tmp_path / "results.json").read_text())
    assert written == {"complete": False, "rows": [{"name": "a"}, {"name": "b"}]}
    assert rows[0]["env"] == {"X": "1"}  # the run's own rows are left as they were


@pytest.mark.parametrize("preset", ["demo.toml", "demo-flux2-klein.toml"])
def test_the_row_without_samples_trains_the_same_preset_sampling_nothing(tmp_path, preset):
    from stabletune_core.config import build_config, read_toml

    shipped = read_toml(ROOT / "presets" / preset)
    quiet = read_toml(bench.preset_without_samples(ROOT / "presets" / preset, tmp_path / "quiet.toml"))
    assert shipped["validation_prompt"] and "validation_prompt" not in quiet and "sample_judge" not in quiet
    assert quiet == {k: v for k, v in shipped.items() if k not in ("validation_prompt", "sample_judge")}
    config = build_config({**quiet, "pretrained_model_name_or_path": str(tmp_path), "train_data_dir": str(tmp_path),
                           "output_dir": str(tmp_path / "run")})
    assert config.validation_prompts == [] and config.learning_rate == shipped["learning_rate"]


# ------------------------------------------------------------------------------ --concepts: the suite (issue 35.6)
def test_without_concepts_the_bench_runs_the_demos_purple_and_suite_colours_only_otherwise():
    assert bench.parse_concepts(None) is None and bench.parse_concepts("") is None
    assert bench.parse_concepts("orange, teal,blue,magenta") == ["orange", "teal", "blue", "magenta"]
    with pytest.raises(SystemExit, match="'ring' is not a suite colour .a shape"):
        bench.parse_concepts("orange,ring")
    with pytest.raises(SystemExit, match="'mauve' is not a suite colour"):
        bench.parse_concepts("mauve")
    with pytest.raises(SystemExit, match="twice"):
        bench.parse_concepts("blue,blue")


def test_a_concepts_preset_is_the_demos_with_validation_prompts_naming_the_concept(tmp_path):
    """As `demo --concept-word NAME` runs it: only the validation prompts change; purple's are the shipped ones."""
    from stabletune_core.config import read_toml

    shipped = read_toml(bench.PRESET)
    orange = read_toml(bench.concept_preset(bench.PRESET, "orange", tmp_path / "orange.toml"))
    prompts = [p.strip() for p in orange["validation_prompt"].split("|")]
    assert prompts[:3] == ["a orange circle", "a orange square", "a orange triangle"]
    assert not any("purple" in p for p in prompts) and len(prompts) == len(shipped["validation_prompt"].split("|"))
    assert {k: v for k, v in orange.items() if k != "validation_prompt"} == \
        {k: v for k, v in shipped.items() if k != "validation_prompt"}
    assert read_toml(bench.concept_preset(bench.PRESET, "purple", tmp_path / "purple.toml")) == shipped
    quiet = bench.preset_without_samples(bench.PRESET, tmp_path / "quiet.toml")
    assert read_toml(bench.concept_preset(quiet, "teal", tmp_path / "teal.toml")) == read_toml(quiet)


def cell(trainer: str, concept: str, budget: float, after: float, worst: float) -> dict:
    measured = {"before": 150.0, "after": after, "drift": {"red": worst, "yellow": 0.1, "green": 0.2, "cyan": 0.0},
                "base_shapes": 1.0}
    return bench.suite_cell(trainer, concept, budget, bench.Snapshot(10, 5.0, Path(concept)), measured)


def test_the_pass_share_is_issue_35_2s_targets_over_every_concept():
    """A cell passes with its colour within 8 degrees and every kept colour within 3 (concept_suite.passes); a
    concept without a snapshot within the budget counts as not passing; the means are over the cells measured."""
    cells = [cell("A", "orange", 1, 7.9, 2.9), cell("A", "teal", 1, 8.1, 0.5), cell("A", "blue", 1, 5.0, 3.1),
             cell("A", "orange", 2, 6.0, 1.0), cell("A", "teal", 2, 4.0, 2.0),  # blue: no snapshot at 2 min
             cell("B", "orange", 1, 30.0, 10.0)]
    assert [c["pass"] for c in cells] == [True, False, False, True, True, False]
    summary = {(s["trainer"], s["budget_min"]): s
               for s in bench.suite_summary(cells, ["A", "B"], ["orange", "teal", "blue"], [1, 2])}
    assert summary[("A", 1)]["pass_share"] == pytest.approx(1 / 3)
    assert summary[("A", 1)]["mean_concept_error"] == pytest.approx((7.9 + 8.1 + 5.0) / 3)
    assert summary[("A", 1)]["mean_worst_drift"] == pytest.approx((2.9 + 0.5 + 3.1) / 3)
    assert summary[("A", 2)]["pass_share"] == pytest.approx(2 / 3) and summary[("A", 2)]["measured"] == 2
    assert summary[("B", 2)] == {"trainer": "B", "budget_min": 2, "measured": 0, "passed": 0, "concepts": 3,
                                 "pass_share": 0.0, "mean_concept_error": None, "mean_worst_drift": None}
    table = bench.suite_tables(cells, list(summary.values()))
    assert "| A | 1 min | 1/3 (33%) | 7.0 | 2.2 |" in table
    assert "| A | 2 min | 2/3 (67%) (2 measured) | 5.0 | 1.5 |" in table


def test_the_suite_slice_trains_each_concept_and_scores_its_measured_cells(tmp_path, toy_cache, toy_base):
    """Two suite colours, StableTune's preset (without validation images, to keep the test short), 4 steps, 1 render
    seed, budgets of 3 s (no snapshot yet) and 5 min: each concept trains on its suite dataset, each cell holds the
    suite's measures of its own LoRA (measured again here), and the pass share and means come from those cells."""
    import subprocess

    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.evaluate import render
    from stabletune_core.toy.judge import concept_reference_in
    from stabletune_core.toy.world import base_prompts

    suite = load_bench("concept_suite")
    quiet = bench.preset_without_samples(bench.PRESET, tmp_path / "quiet.toml")
    out = tmp_path / "out"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "bench/toy_quality.py", "--concepts", "blue,magenta", "--stabletune-only",
                           "--preset", str(quiet), "--max-steps", "4", "--snapshot-steps", "2", "--budgets", "0.05,5",
                           "--threads", "1", "--render-seeds", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["concepts"] == ["blue", "magenta"] and results["budgets_min"] == [0.05, 5]
    cells = results["cells"]
    assert [(c["concept"], c["budget_min"], c["step"]) for c in cells] == [("blue", 5, 4), ("magenta", 5, 4)]
    for name in ("blue", "magenta"):  # each concept's own suite dataset: its 12 images and the base's priors
        data = out / "data" / name
        assert len(list((data / f"1_{name}").glob("*.png"))) == 12 and any((data / "1_known_colours").glob("*.png"))
        assert f"--train_data_dir {data}" in " ".join(results["runs"][name][0]["command"])
    # a cell's measures are concept_suite.measure_cell's of that run's LoRA, and its verdict concept_suite.passes'
    blue = suite.Concept("blue")
    toy = TOY_BASES["sd1"]
    base = render(toy.pipeline(toy_base), base_prompts() + blue.prompts(), [1000])
    lora = next((out / "blue" / "run-0-stabletune" / "output").glob("bench_step_*4.safetensors"))
    again = suite.measure_cell(blue, lora, toy_base, base, [1000], concept_reference_in(out / "data" / "blue", "blue"),
                               toy.pipeline)
    assert cells[0]["after"] == pytest.approx(again["after"], abs=0.5)
    assert cells[0]["drift"] == pytest.approx(again["drift"], abs=0.5)
    for c in cells:
        assert c["pass"] == suite.passes(c)
    # the summary, recomputed from the measured cells
    name = results["runs"]["blue"][0]["name"]
    summary = {s["budget_min"]: s for s in results["summary"]}
    assert summary[0.05]["measured"] == 0 and summary[0.05]["pass_share"] == 0
    assert summary[5]["pass_share"] == sum(suite.passes(c) for c in cells) / 2
    assert summary[5]["mean_concept_error"] == pytest.approx((cells[0]["after"] + cells[1]["after"]) / 2)
    assert summary[5]["mean_worst_drift"] == pytest.approx(sum(max(c["drift"].values()) for c in cells) / 2)
    table = (out / "table.md").read_text()
    assert f"| {name} | 5 min | {summary[5]['passed']}/2 ({summary[5]['pass_share']:.0%}) | " \
           f"{summary[5]['mean_concept_error']:.1f} | {summary[5]['mean_worst_drift']:.1f} |" in table
