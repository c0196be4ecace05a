"""The features added in the last round end in a known state too (issue 24).

Each test drives the CLI in a real subprocess (`python -m stabletune_core ...`) on the tiny model and judges only
what a user sees: the exit code, the single `error: ...` sentence on stderr (no traceback), status.json, the run
folder's files, and that nothing the user made changed. No test names an engine function, so they hold across a
refactor of the engine.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_failures import (ROOT, TIMEOUT, assert_failed, base_flags, environment, status, train, tree_hash,
                           user_files)  # noqa: F401 (user_files is a fixture)


def cli(*args: str, entry: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    """Any command of `python -m stabletune_core` (or `entry`, a wrapper that ends in the same CLI)."""
    entry = entry or [sys.executable, "-m", "stabletune_core"]
    return subprocess.run([*entry, *args], cwd=ROOT, env=environment(**env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def copy_dataset(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def lora_is_trained(path: Path) -> bool:
    """Some up factor of the exported LoRA moved away from its zero start: the file does something."""
    from safetensors.torch import load_file

    return any(float(t.abs().max()) > 0 for k, t in load_file(path).items() if k.endswith("lora_up.weight"))


@pytest.fixture(scope="module")
def finished_run(tiny_model: Path, shapes_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run with checkpoints at steps 2 and 3 (rank 4, plain LoRA); copy it before changing it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--save_steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def copied_run(finished: Path, target: Path) -> Path:
    shutil.copytree(finished, target)
    return target


# ---- item 1: a run folder inside the regularisation folder ---------------------------------------------------
@pytest.mark.parametrize("where", ["inside", "equal"])
def test_run_folder_inside_reg_data_dir_is_refused(where, tiny_model, shapes_dataset, tmp_path, user_files):
    reg = copy_dataset(shapes_dataset, tmp_path / "class")
    before, reg_before = user_files(), tree_hash(reg)
    run = reg / "run" if where == "inside" else reg
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--reg_data_dir", str(reg)])
    sentence = assert_failed(result, None, "reg_data_dir", code=2, before=before, after=user_files())
    assert "output folder outside it" in sentence
    assert tree_hash(reg) == reg_before and not (reg / "run").exists()  # not a byte among the class images


# ---- items 2 and 3: masks that keep nothing or cannot be read --------------------------------------------------
def _write_masks(data: Path, masks: dict[str, str]) -> None:
    """masks: {image stem: 'black' | 'corrupt' | 'empty'}, written as NAME.mask.png beside the image."""
    from PIL import Image

    for stem, kind in masks.items():
        path = data / f"{stem}.mask.png"
        if kind == "black":
            with Image.open(data / f"{stem}.png") as image:
                Image.new("L", image.size, 0).save(path)
        else:
            path.write_bytes(b"" if kind == "empty" else b"\x89PNG\r\n\x1a\n not a mask")


def test_all_black_masks_are_refused_before_training(tiny_model, shapes_dataset, tmp_path):
    """Every mask black: the loss and every gradient would be 0 at every step and the LoRA all zeros."""
    data = copy_dataset(shapes_dataset, tmp_path / "data")
    _write_masks(data, {p.stem: "black" for p in data.glob("*.png")})
    data_before = tree_hash(data)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run) + ["--masked_loss"])
    sentence = assert_failed(result, run, "mask", code=1)
    assert "black" in sentence and "masked_loss" in sentence
    assert tree_hash(data) == data_before
    assert not list(run.glob("output/*")) and not list(run.glob("checkpoints/*"))


def test_masks_that_keep_nothing_or_cannot_be_read_skip_their_image(tiny_model, shapes_dataset, tmp_path):
    """One black, one corrupt and one empty mask among 8 images: each of those images is skipped with a console
    line (like an unreadable image), the others train, the LoRA is not zero."""
    data = copy_dataset(shapes_dataset, tmp_path / "data")
    _write_masks(data, {"shape_001": "black", "shape_002": "corrupt", "shape_004": "empty"})
    data_before = tree_hash(data)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run) + ["--masked_loss", "--max_train_steps", "4",
                                                        "--validation_split", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert status(run)["state"] == "finished"
    skipped = [line for line in result.stderr.splitlines() if "mask" in line and "kip" in line]
    assert skipped, result.stderr[-3000:]
    for name in ("shape_001.mask.png", "shape_002.mask.png", "shape_004.mask.png"):
        assert any(name in e["message"] for e in events(run) if e["kind"] == "data_skipped"), name
    assert lora_is_trained(run / "output" / "lora.safetensors")
    assert tree_hash(data) == data_before


def test_masks_are_not_read_without_masked_loss(tiny_model, shapes_dataset, tmp_path):
    """--no-masked_loss: mask files play no part, so broken ones cannot stop the run and the LoRA is bitwise the
    LoRA of the same data with no mask files at all."""
    from safetensors.torch import load_file

    plain = copy_dataset(shapes_dataset, tmp_path / "plain")
    data = copy_dataset(shapes_dataset, tmp_path / "data")
    _write_masks(data, {p.stem: ("corrupt", "empty")[i % 2] for i, p in enumerate(sorted(data.glob("*.png")))})
    loras = {}
    for name, folder in (("plain", plain), ("broken masks", data)):
        run = tmp_path / f"run-{name.replace(' ', '-')}"
        result = train(base_flags(tiny_model, folder, run) + ["--no-masked_loss", "--max_train_steps", "4",
                                                              "--validation_split", "0"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "error:" not in result.stderr
        assert status(run)["state"] == "finished"
        loras[name] = load_file(run / "output" / "lora.safetensors")
    assert loras["plain"].keys() == loras["broken masks"].keys()
    changed = [key for key in loras["plain"] if not torch.equal(loras["plain"][key], loras["broken masks"][key])]
    assert not changed, changed[:3]


# ---- item 4: every command keeps the train command's contract ----------------------------------------------------
def _kohya_lora(path: Path, *, nan: bool = False, up_rank: int = 4, nan_alpha: bool = False) -> Path:
    """A small kohya-format LoRA file: two modules, rank 4 (a Linear and a conv)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, down_shape, up_shape in (("lora_unet_a_to_q", (4, 32), (32, up_rank)),
                                       ("lora_unet_b_conv", (4, 16, 3, 3), (8, up_rank, 1, 1))):
        tensors[f"{name}.lora_down.weight"] = torch.randn(down_shape, generator=generator)
        tensors[f"{name}.lora_up.weight"] = torch.randn(up_shape, generator=generator)
        tensors[f"{name}.alpha"] = torch.tensor(4.0)
    if nan:
        tensors["lora_unet_a_to_q.lora_up.weight"][0, 0] = float("nan")
    if nan_alpha:
        tensors["lora_unet_b_conv.alpha"] = torch.tensor(float("nan"))
    save_file(tensors, str(path), metadata={"ss_network_dim": "4", "ss_network_alpha": "4"})
    return path


#: Root writes into a read-only folder anyway; for it, refuse as the kernel refuses everyone else (EACCES).
READ_ONLY_AS_FOR_A_USER = """
import errno, os, stat, sys
if os.geteuid() == 0:
    real_open = os.open
    def refusing_open(path, flags, *args, **kwargs):
        folder = os.path.dirname(os.path.abspath(path))
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and not os.stat(folder).st_mode & 0o222:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)
    os.open = refusing_open
from stabletune_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def assert_one_sentence(result: subprocess.CompletedProcess, expected: str) -> str:
    return assert_failed(result, None, expected)


@pytest.mark.parametrize("case, expected", [
    ("nan", "NaN"),
    ("nan-alpha", "NaN"),
    ("ranks", "rank"),
    ("folder", "is a folder"),
    ("read-only", "Cannot write"),
])
def test_resize_refuses_a_bad_lora_in_one_sentence(case, expected, tmp_path):
    folder = tmp_path / "loras"
    folder.mkdir()
    lora = _kohya_lora(folder / "mine.safetensors", nan=case == "nan", up_rank=8 if case == "ranks" else 4,
                       nan_alpha=case == "nan-alpha")
    before = tree_hash(folder)
    target = folder if case == "folder" else lora
    if case == "read-only":
        folder.chmod(0o555)
    try:
        result = cli("resize", str(target), "--rank", "2", entry=[sys.executable, "-c", READ_ONLY_AS_FOR_A_USER])
    finally:
        folder.chmod(0o755)
    sentence = assert_one_sentence(result, expected)
    assert "internal error" not in sentence
    assert tree_hash(folder) == before  # the input is untouched, no half-written output or temporary beside it


@pytest.mark.parametrize("case, expected", [("missing", "does not exist"), ("truncated", "truncated")])
def test_inspect_a_missing_or_truncated_file_is_one_sentence(case, expected, tmp_path):
    lora = _kohya_lora(tmp_path / "mine.safetensors")
    if case == "truncated":
        data = lora.read_bytes()
        lora.write_bytes(data[: len(data) // 2])
    target = lora if case == "truncated" else tmp_path / "nowhere.safetensors"
    sentence = assert_one_sentence(cli("inspect", str(target)), expected)
    assert "internal error" not in sentence


def test_export_of_a_corrupt_checkpoint_is_one_sentence(finished_run, tmp_path):
    run = copied_run(finished_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step_000002"
    (checkpoint / "adapter.safetensors").write_bytes(b"garbage")
    before = tree_hash(run)
    sentence = assert_one_sentence(cli("export", str(checkpoint)), "step_000002")
    assert "sha256" in sentence and "--resume" not in sentence  # an export sentence, not the resume one
    assert tree_hash(run) == before


def test_export_name_is_a_file_name_not_a_path(finished_run, tmp_path):
    """--name '../x' wrote the LoRA outside the run folder; 'a/b' made a folder in RUN/output."""
    run = copied_run(finished_run, tmp_path / "sub" / "run")
    before = tree_hash(tmp_path)
    for name in ("../../escaped", "a/b"):
        sentence = assert_one_sentence(cli("export", str(run / "checkpoints" / "step_000002"), "--name", name),
                                       "--name")
        assert "internal error" not in sentence
    assert tree_hash(tmp_path) == before


# ---- item 5: one live trainer per run folder ----------------------------------------------------------------------
def _start(flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stabletune_core", "train", *flags], cwd=ROOT, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_training(run: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        try:
            if status(run).get("state") == "training" and status(run).get("step", 0) >= 1:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the first trainer never trained: {proc.poll()}")


def test_two_trainers_started_at_once_train_one_run(tiny_model, shapes_dataset, tmp_path):
    """The issue's case: both trained into the folder and both exited 0 (two metric lines per step)."""
    run = tmp_path / "run"
    procs = [_start(base_flags(tiny_model, shapes_dataset, run)) for _ in range(2)]
    results = [(proc, *proc.communicate(timeout=TIMEOUT)) for proc in procs]
    winners = [proc for proc, _, _ in results if proc.returncode == 0]
    losers = [(proc, stderr) for proc, _, stderr in results if proc.returncode != 0]
    assert len(winners) == 1 and len(losers) == 1, [(p.returncode, err[-1500:]) for p, _, err in results]
    loser, stderr = losers[0]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(winners[0].pid) in errors[0], stderr[-2000:]
    assert status(run)["state"] == "finished" and status(run)["pid"] == winners[0].pid
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_second_trainer_on_a_live_run_folder_is_refused(tiny_model, shapes_dataset, tmp_path):
    """A second start and a `--resume auto` into the folder of a live trainer are refused naming its process,
    without touching its status; a killed trainer does not leave the folder locked."""
    run = tmp_path / "run"
    flags = base_flags(tiny_model, shapes_dataset, run)
    first = _start(flags + ["--max_train_steps", "100000", "--save_steps", "2"])
    try:
        _wait_for_training(run, first)
        for extra in ([], ["--resume", "auto"]):
            result = train(flags + extra)
            sentence = assert_failed(result, None, str(first.pid))
            assert "internal error" not in sentence
            live = status(run)
            assert live["pid"] == first.pid and live["state"] in ("training", "saving", "sampling")
        metric_steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert metric_steps == sorted(set(metric_steps))  # one trainer wrote them
    finally:
        first.kill()
        first.communicate(timeout=60)
    result = train(flags + ["--resume", "auto", "--max_train_steps", str(status(run)["step"] + 2)])
    assert result.returncode == 0, result.stderr[-3000:]  # the lock went with the killed process
    assert status(run)["state"] == "finished"


# ---- item 6: resume with other adapter settings -------------------------------------------------------------------
@pytest.mark.parametrize("change, names", [
    (["--lora_rank", "8"], ["lora_rank", "4", "8"]),
    (["--network_type", "lokr"], ["network_type", "lora", "lokr"]),
    (["--use_dora"], ["use_dora"]),
    (["--optimizer", "lion"], ["optimizer", "adamw", "lion"]),  # silently loaded AdamW's state into Lion
    (["--optimizer", "adamw_schedulefree"], ["optimizer", "adamw", "adamw_schedulefree"]),  # KeyError
])
def test_resume_with_other_adapter_settings_is_refused_and_changes_nothing(change, names, finished_run, tiny_model,
                                                                           shapes_dataset, tmp_path, user_files):
    run = copied_run(finished_run, tmp_path / "run")

    def kept_files() -> dict[str, str]:  # all but the refusal's own status and event
        return {k: v for k, v in tree_hash(run).items() if not k.endswith(("status.json", "events.jsonl"))}

    kept = kept_files()
    before = user_files()
    flags = base_flags(tiny_model, shapes_dataset, run) + ["--resume", "auto", "--max_train_steps", "5"]
    result = train(flags + change)
    sentence = assert_failed(result, run, names[0], code=2, before=before, after=user_files())
    assert "internal error" not in sentence and all(name in sentence for name in names), sentence
    assert kept_files() == kept  # config.toml too: `train --config RUN/config.toml --resume auto` still continues
    if change[0] == "--lora_rank":  # the run's own config still continues it, as it did before the refusal
        result = train(["--config", str(run / "config.toml"), "--output_dir", str(run), "--resume", "auto",
                        "--max_train_steps", "4"])  # (the copy's config.toml names the original's folder)
        assert result.returncode == 0, result.stderr[-3000:]
        assert status(run)["state"] == "finished" and status(run)["step"] == 4


def test_resume_past_max_train_steps_is_refused(finished_run, tiny_model, shapes_dataset, tmp_path):
    """The run is at step 3; --max_train_steps 2 trained nothing, rewrote the LoRA and ended 'finished' at step 3
    of 2."""
    run = copied_run(finished_run, tmp_path / "run")
    lora = (run / "output" / "lora.safetensors").read_bytes()
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--resume", "auto", "--max_train_steps", "2"])
    sentence = assert_failed(result, run, "max_train_steps", code=2)
    assert "step_000003" in sentence and "internal error" not in sentence
    assert (run / "output" / "lora.safetensors").read_bytes() == lora


# ---- beyond: a class image that cannot be read, a control.json that is not a command -----------------------------
def test_an_unreadable_class_image_is_skipped_with_a_line(tiny_model, shapes_dataset, tmp_path):
    """Unreadable training images were listed and said; unreadable class images were dropped without a word."""
    reg = copy_dataset(shapes_dataset, tmp_path / "class")
    (reg / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--reg_data_dir", str(reg)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert any("broken.png" in line and "kip" in line for line in result.stderr.splitlines()), result.stderr[-3000:]
    assert any("broken.png" in e["message"] for e in events(run) if e["kind"] == "data_skipped")


def test_a_control_file_that_is_not_a_command_is_ignored_with_a_line(tiny_model, shapes_dataset, tmp_path):
    """control.json holding a JSON string (or bytes that are not UTF-8) was an internal error mid-run, losing
    every step since the last checkpoint."""
    run = tmp_path / "run"
    proc = _start(base_flags(tiny_model, shapes_dataset, run) + ["--max_train_steps", "100000"])
    try:
        _wait_for_training(run, proc)
        for payload in (b'"sample"', b"\xff\xfe not text"):
            (run / "control.json").write_bytes(payload)
            deadline = time.time() + TIMEOUT
            while (run / "control.json").exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)
        (run / "control.json").write_text(json.dumps({"command": "stop"}))
        _, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "internal error" not in stderr
    assert sum("control.json" in line and "gnored" in line for line in stderr.splitlines()) == 2, stderr[-3000:]
    final = status(run)
    assert final["state"] == "stopped" and (run / "output" / "lora.safetensors").is_file()
    assert (run / "checkpoints" / f"step_{final['step']:06d}" / "manifest.json").is_file()


# ---- item 7: a full disk at the final export, a missing optional package ------------------------------------------
EXPORT_DISK_FULL = """
import sys
import safetensors, safetensors.torch
real = safetensors.torch.save_file
def full(tensors, filename, *args, **kwargs):
    if "/output/" in str(filename):  # the LoRA files; checkpoints are written as usual
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')
    return real(tensors, filename, *args, **kwargs)
safetensors.torch.save_file = full
from stabletune_core.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_full_disk_at_the_final_export_is_the_disk_full_sentence(tiny_model, shapes_dataset, tmp_path, user_files):
    before = user_files()
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run), entry=[sys.executable, "-c", EXPORT_DISK_FULL])
    sentence = assert_failed(result, run, "The disk is full", code=1, before=before, after=user_files())
    assert "internal error" not in sentence and "--resume auto" in sentence
    assert not list((run / "output").iterdir())  # no half-written LoRA, no temporary
    assert (run / "checkpoints" / "step_000003" / "manifest.json").is_file()  # what --resume auto continues


def test_adamw8bit_without_bitsandbytes_is_refused_before_the_model_loads(tiny_model, shapes_dataset, tmp_path,
                                                                         user_files):
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here; the missing-package sentence cannot be reached")
    before = user_files()
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--optimizer", "adamw8bit"])
    sentence = assert_failed(result, run, "bitsandbytes", code=2, before=before, after=user_files())
    assert "internal error" not in sentence and "pip install" in sentence
    assert status(run).get("step", 0) == 0 and not list(run.glob("checkpoints/*"))
    assert not [e for e in events(run) if e["kind"] in ("latent_cache", "placement")]  # no model was loaded


# ---- item 8: CPU threads ----------------------------------------------------------------------------------------
def _thread_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in environment(**extra).items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.mark.parametrize("override", [None, "2"])
def test_cpu_run_chooses_its_thread_count_and_says_so(override, tiny_model, shapes_dataset, tmp_path):
    """No thread setting: the tiny (dispatch-bound) model trains on one thread, said in one console line;
    OMP_NUM_THREADS, when set, wins and the line says so."""
    run = tmp_path / "run"
    env = _thread_env(**({"OMP_NUM_THREADS": override} if override else {}))
    result = subprocess.run([sys.executable, "-m", "stabletune_core", "train",
                             *base_flags(tiny_model, shapes_dataset, run)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "CPU thread" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    chosen = [e for e in events(run) if e["kind"] == "threads"]
    assert len(chosen) == 1
    if override:
        assert chosen[0]["threads"] == 2 and "OMP_NUM_THREADS" in lines[0]
    else:
        assert chosen[0]["threads"] == 1 and "OMP_NUM_THREADS" in lines[0]  # how to choose another count
