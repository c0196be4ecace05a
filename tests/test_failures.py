"""Every run ends `finished`, `stopped` or `failed` with one sentence (issue 15).

Real training processes (`python -m stabletune_core train`, `train_lora.py`, `accelerate launch`) on the tiny
model. Every failure asserts: the exit code, the sentence once on stderr as `error: ...` and no traceback,
status.json `failed` with the same sentence, and that the dataset and the model are byte for byte unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stabletune_core.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300


# ---- helpers -------------------------------------------------------------------------------------------------
def tree_hash(*folders: Path) -> dict[str, str]:
    """sha256 and mode of every file under the folders: what 'nothing the user made changed' means."""
    hashes = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file() and not path.is_symlink():
                hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() + oct(path.stat().st_mode)
    return hashes


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1", **extra}
    if "STABLETUNE_FAULTS" not in extra:
        env.pop("STABLETUNE_FAULTS", None)
    return env


def base_flags(model: Path, data: Path, out: Path) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--bucket_step", "8", "--min_bucket_reso", "32", "--max_bucket_reso", "128",
            "--train_batch_size", "2", "--max_train_steps", "3", "--lora_rank", "4", "--save_steps", "1000",
            "--seed", "3"]


def train(flags: list[str], *, entry: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    entry = entry or [sys.executable, "-m", "stabletune_core", "train"]
    return subprocess.run([*entry, *flags], cwd=ROOT, env=environment(**env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def assert_failed(result: subprocess.CompletedProcess, run: Path | None, expected: str, *, code: int | None = None,
                  before: dict | None = None, after: dict | None = None) -> str:
    """The single sentence on stderr (containing `expected`), no traceback, status.json failed with it."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line[len("error: "):] for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    sentence = errors[0]
    assert expected in sentence, sentence
    assert result.returncode != 0
    if code is not None:
        assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    if run is not None:
        assert status(run)["state"] == "failed"
        assert status(run)["error"] == sentence
    if before is not None:
        assert after == before, "a user file changed"
    return sentence


@pytest.fixture
def user_files(tiny_model: Path, shapes_dataset: Path):
    """The hash of the model and the dataset; call it again after the run to compare."""
    return lambda: tree_hash(tiny_model, shapes_dataset)


# ---- item 1 + "Done when": the seed's recommended command ------------------------------------------------------
SEED_COMMAND = ["--mixed_precision", "fp16", "--gradient_checkpointing",
                "--validation_prompt", "a red circle | a blue square",
                "--validation_steps", "2", "--validation_inference_steps", "2", "--num_validation_images", "1",
                "--learning_rate", "1e-4", "--lora_alpha", "8", "--gradient_accumulation_steps", "2",
                "--max_train_steps", "2"]


@pytest.mark.parametrize("launcher", ["train_lora.py", "accelerate launch"])
def test_seed_command_fp16_with_validation_prompt_finishes(launcher, tiny_model, shapes_dataset, tmp_path,
                                                           user_files):
    """The README's command (fp16, gradient checkpointing, validation prompts) through both entry points: on a
    CPU fp16 runs as asked, with one console line saying so; it crashed at the first vae.decode before."""
    before = user_files()
    run = tmp_path / "run"
    entry = ([sys.executable, "train_lora.py"] if launcher == "train_lora.py" else
             [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", "train_lora.py"])
    result = train([*base_flags(tiny_model, shapes_dataset, run), *SEED_COMMAND], entry=entry)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert status(run)["state"] == "finished"
    assert (run / "output" / "lora.safetensors").is_file()
    for step in ("step_000000", "step_000002"):
        assert sorted(p.name for p in (run / "samples" / step).glob("*.png")) == ["p00_s3.png", "p01_s3.png"]
    assert "no GPU" in result.stderr  # fp16 on a CPU is one console line
    assert user_files() == before


@pytest.mark.parametrize("precision", ["no", "fp16", "bf16"])
def test_sampling_works_in_every_precision(precision, tiny_config, one_thread):
    """Validation images in fp16 (VAE fp32, UNet fp16), bf16 and fp32, with gradient checkpointing on, and with
    xformers asked for but missing (one console line, SDPA used)."""
    import numpy as np
    from PIL import Image

    from accelerate.state import AcceleratorState

    from stabletune_core.train.loop import sample, setup

    AcceleratorState._reset_state(reset_partial_state=True)  # each precision needs its own Accelerator
    config = tiny_config(mixed_precision=precision, gradient_checkpointing=True, validation_prompt="a red circle",
                         validation_inference_steps=2, num_validation_images=1,
                         enable_xformers_memory_efficient_attention=True)
    s = setup(config)
    sample(s)
    images = list(s.run.paths.sample_dir(0).glob("*.png"))
    assert len(images) == 1
    pixels = np.asarray(Image.open(images[0]))
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0  # a real decoded image, not a blank
    events = [json.loads(line) for line in s.run.paths.events.read_text().splitlines()]
    assert any(e["kind"] == "attention" and "SDPA" in e["message"] for e in events)


# ---- items 4, 5, 6, 7, 8: bad input, before any model loads ------------------------------------------------------
def _bad_dataset(kind: str, folder: Path, good: Path) -> Path:
    folder.mkdir()
    if kind == "empty":
        pass
    elif kind == "captions only":
        for i in range(3):
            (folder / f"img{i}.txt").write_text("a caption")
    elif kind == "unreadable":
        for i in range(3):
            (folder / f"img{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    elif kind == "gif only":
        from PIL import Image

        Image.new("RGB", (64, 64), "red").save(folder / "a.gif")
    elif kind == "symlink loop":
        os.symlink(folder / "b.png", folder / "a.png")
        os.symlink(folder / "a.png", folder / "b.png")
    return folder


@pytest.mark.parametrize("kind, expected", [
    ("empty", "holds no images"),
    ("captions only", "it has 3 .txt files"),
    ("unreadable", "holds no usable images: all 3 were skipped"),
    ("gif only", "GIF files are not trained on"),
    ("symlink loop", "symbolic link that loops back on itself"),
])
def test_unusable_dataset_fails_with_a_sentence(kind, expected, tiny_model, shapes_dataset, tmp_path, user_files):
    data = _bad_dataset(kind, tmp_path / "data", shapes_dataset)
    before, data_before = user_files(), tree_hash(data)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run))
    assert_failed(result, run, expected, code=1, before=before, after=user_files())
    assert tree_hash(data) == data_before
    assert not list(run.glob("checkpoints/*")) and not list(run.glob("output/*"))


def _truncated_safetensors(folder: Path, model: Path) -> Path:
    source = model / "unet" / "diffusion_pytorch_model.safetensors"
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path = folder / "model.safetensors"
    path.write_bytes(data[: 8 + length + 1000])  # header intact, tensors cut off: an interrupted download
    return path


@pytest.mark.parametrize("kind, expected", [
    (".ckpt", "pickle"),
    (".txt", "is not a model StableTune can read"),
    ("folder", "is not a diffusers model"),
    ("truncated", "is truncated"),
])
def test_bad_model_path_fails_before_the_dataset_scan(kind, expected, tiny_model, shapes_dataset, tmp_path,
                                                     user_files):
    bad = tmp_path / "models"
    bad.mkdir()
    model = {".ckpt": bad / "model.ckpt", ".txt": bad / "model.txt", "folder": bad}.get(kind)
    if kind in (".ckpt", ".txt"):
        model.write_bytes(b"not a model")
    if kind == "truncated":
        model = _truncated_safetensors(bad, tiny_model)
    before = user_files()
    run = tmp_path / "run"
    started = time.perf_counter()
    result = train(base_flags(model, shapes_dataset, run))
    assert_failed(result, run, expected, code=2, before=before, after=user_files())
    assert "torch" not in result.stderr  # refused by the config check, before torch is even imported
    assert time.perf_counter() - started < 60


@pytest.mark.parametrize("flags, expected", [
    (["--seed", str(2**70)], "seed is 1180591620717411303424 but must be at most 4294967295"),
    (["--seed", "-2"], "seed is -2 but must be at least -1"),
    (["--learning_rate", "nan"], "learning_rate is not a number (NaN)"),
    (["--resume", "{tmp}/nowhere"], "is not a checkpoint folder"),
])
def test_bad_values_fail_with_a_sentence(flags, expected, tiny_model, shapes_dataset, tmp_path, user_files):
    before = user_files()
    run = tmp_path / "run"
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    result = train(base_flags(tiny_model, shapes_dataset, run) + flags)
    assert_failed(result, run, expected, code=2, before=before, after=user_files())


def test_output_dir_under_a_regular_file_fails_with_a_sentence(tiny_model, shapes_dataset, tmp_path, user_files):
    before = user_files()
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    result = train(base_flags(tiny_model, shapes_dataset, blocker / "run"))
    assert_failed(result, None, "is a file, not a folder", code=2, before=before, after=user_files())
    assert blocker.read_text() == "mine"


def test_corrupt_resume_checkpoint_is_refused_before_the_model_loads(tiny_model, shapes_dataset, tmp_path,
                                                                     user_files):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 2, "files": {"adapter.safetensors": "00"}}))
    (checkpoint / "adapter.safetensors").write_bytes(b"garbage")
    mine = tree_hash(checkpoint)
    # A model folder that passes the checks of the outside world but cannot load: had the engine loaded the model
    # before reading the checkpoint, the sentence would be "Could not load ..." instead.
    unloadable = tmp_path / "unloadable-model"
    (unloadable / "unet").mkdir(parents=True)
    (unloadable / "model_index.json").write_text((tiny_model / "model_index.json").read_text())
    before = user_files()
    result = train(base_flags(unloadable, shapes_dataset, tmp_path / "run") + ["--resume", str(checkpoint)])
    sentence = assert_failed(result, tmp_path / "run", "Cannot resume: checkpoint", code=1, before=before,
                             after=user_files())
    assert "sha256" in sentence and "Could not load" not in result.stderr  # refused before the model load
    assert tree_hash(checkpoint) == mine


# ---- item 9: a run in which every step is non-finite --------------------------------------------------------------
def test_all_steps_non_finite_fails_without_a_useless_lora(tiny_model, shapes_dataset, tmp_path, user_files):
    before = user_files()
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--lora_alpha", "1e38", "--max_train_steps", "4"])
    sentence = assert_failed(result, run, "non-finite loss or gradient", code=1, before=before, after=user_files())
    assert "lower learning_rate" in sentence and "lora_alpha" in sentence
    assert not list((run / "output").glob("*.safetensors"))
    rollbacks = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
                 if '"rollback"' in line]
    assert rollbacks and "learning rate 0.0001 -> 5e-05" in rollbacks[0]["message"]


def test_rollback_reports_the_real_rate_during_warm_up(tiny_config, one_thread):
    """In warm-up the current rate is ~0; the rollback names the schedule's peak before and after."""
    from accelerate.state import AcceleratorState

    from stabletune_core.train import faults
    from stabletune_core.train.loop import train as train_loop

    AcceleratorState._reset_state(reset_partial_state=True)  # an earlier test may have left another precision
    config = tiny_config(lr_scheduler="linear", lr_warmup_steps=100, max_train_steps=4, learning_rate=2e-4,
                         nan_max_bad=2)
    faults.install("nan_loss@1,nan_loss@2")
    try:
        train_loop(config)
    finally:
        faults.install(None)
    events = [json.loads(line) for line in (Path(config.output_dir) / "events.jsonl").read_text().splitlines()]
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert "learning rate 0.0002 -> 0.0001" in rollback["message"]


# ---- item 3: a full disk ------------------------------------------------------------------------------------------
def test_checkpoints_that_cannot_be_written_stop_the_run(tiny_model, shapes_dataset, tmp_path, user_files):
    """torch.save's RuntimeError and an OSError ENOSPC: each is a console line; three in a row stop the run with
    a sentence, keeping the last good checkpoint."""
    before = user_files()
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--save_steps", "1", "--max_train_steps", "6"],
                   STABLETUNE_FAULTS="torch_full@save:2,disk_full@save:3,torch_full@save:4")
    sentence = assert_failed(result, run, "3 checkpoints in a row could not be written", code=1, before=before,
                             after=user_files())
    assert "step_000001" in sentence and "--resume auto" in sentence
    assert result.stderr.count("checkpoint_failed (step") == 3  # one console line per failure, the first at once
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]


STATUS_FULL = """
import errno, sys
from stabletune_core.runs import writer
real = writer.write_json_atomic
full_now = []
def full(path, data, **options):
    if full_now or (data.get("state") == "training" and data.get("step", 0) >= 2):
        full_now.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(path, data, **options)
writer.write_json_atomic = full
from stabletune_core.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_disk_full_between_checkpoints_fails_with_a_sentence(tiny_model, shapes_dataset, tmp_path, user_files):
    """The status.json heartbeat hits a full disk mid-run: one sentence, not an OSError traceback."""
    before = user_files()
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run), entry=[sys.executable, "-c", STATUS_FULL])
    assert_failed(result, None, "The disk is full", code=1, before=before, after=user_files())
    assert status(run)["state"] == "training"  # the disk stayed full: status.json could not be replaced, and
    # the sentence is on the console, which is all a full disk allows


def test_interrupted_checkpoint_folders_are_removed_by_the_next_run(tiny_model, shapes_dataset, tmp_path):
    """A kill mid-checkpoint leaves .tmp_step_*; the next run of that directory removes it. The same run:
    seed -1 is a random seed recorded in config.toml (item 6), a warm-up longer than the run is one console line
    (item 15) and the exported files get the user's normal permissions (item 16)."""
    run = tmp_path / "run"
    leftover = run / "checkpoints" / ".tmp_step_000004_999999999"
    leftover.mkdir(parents=True)
    (leftover / "adapter.safetensors").write_bytes(b"half")
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--seed", "-1", "--save_steps", "2",
                                                                  "--lr_scheduler", "linear",
                                                                  "--lr_warmup_steps", "10"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not leftover.exists()
    seed = int(next(line for line in (run / "config.toml").read_text().splitlines()
                    if line.startswith("seed =")).split("=")[1])
    assert 0 <= seed < 2**32 and f"random seed {seed}" in result.stderr
    assert "lr_warmup_steps (10) is not shorter than the run" in result.stderr
    mask = os.umask(0)
    os.umask(mask)
    for path in [run / "output" / "lora.safetensors", *run.glob("checkpoints/step_*/adapter.safetensors")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path


# ---- item 10: every checkpoint corrupt at --resume auto ----------------------------------------------------------
def test_resume_auto_with_only_corrupt_checkpoints_is_refused(tiny_model, shapes_dataset, tmp_path, user_files):
    run = tmp_path / "run"
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{not json")
    mine = tree_hash(run)
    before = user_files()
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--resume", "auto"])
    sentence = assert_failed(result, run, "None of the 2 checkpoints", code=1, before=before, after=user_files())
    assert "--allow_restart" in sentence
    assert {k: v for k, v in tree_hash(run).items() if "checkpoints" in k} == mine

    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--resume", "auto", "--allow_restart"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting over from step 0" in result.stderr
    assert status(run)["state"] == "finished"


# ---- item 11: signals --------------------------------------------------------------------------------------------
def _start(flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stabletune_core", "train", *flags], cwd=ROOT, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run: Path, proc: subprocess.Popen, step: int = 1) -> None:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        try:
            current = status(run)
            if current.get("state") == "training" and current.get("step", 0) >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the run never reached step {step}: {proc.poll()}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_saves_a_checkpoint_and_the_lora_then_stops(signum, tiny_model, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    proc = _start(base_flags(tiny_model, shapes_dataset, run) + ["--max_train_steps", "100000"])
    _wait_for_step(run, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    final = status(run)
    assert final["state"] == "stopped" and final["step"] >= 1
    step = final["step"]
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    assert (run / "output" / "lora.safetensors").is_file()


def test_second_ctrl_c_exits_at_once(tiny_model, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    # Sixteen micro-batches per step: the second Ctrl-C lands inside the step the first one lets finish (with
    # one, the tiny run could save and exit first; that case has its own test below).
    proc = _start(base_flags(tiny_model, shapes_dataset, run) + ["--max_train_steps", "100000",
                                                                  "--gradient_accumulation_steps", "16"])
    _wait_for_step(run, proc)
    proc.send_signal(signal.SIGINT)
    # Two signals that arrive while the main thread is inside one C call reach Python's handler once: send the
    # second only after the first was heard.
    heard = ""
    while "finishing this step" not in heard:
        line = proc.stderr.readline()
        assert line, heard
        heard += line
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    stderr = heard + stderr
    assert proc.returncode == 130
    assert "Traceback" not in stderr
    assert "second Ctrl-C" in stderr
    assert status(run)["state"] == "stopped" and "without saving" in status(run)["error"]


# ---- items 2 and 15: the launcher and the console ------------------------------------------------------------
def test_accelerate_launch_failure_prints_only_the_sentence(tiny_model, shapes_dataset, tmp_path, user_files,
                                                            monkeypatch):
    """LPIPS weights missing offline: through `accelerate launch` the sentence, naming the file and the folder it
    belongs in, is all that is printed (no CalledProcessError)."""
    before = user_files()
    run = tmp_path / "run"
    hub = tmp_path / "torch-hub"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--perceptual_lambda", "0.1"],
                   entry=[sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
                          "train_lora.py"], TORCH_HOME=str(hub))
    sentence = assert_failed(result, run, "perceptual_lambda needs the ImageNet weights", before=before,
                             after=user_files())
    assert f"put alexnet-owt-7be5be79.pth (from https://download.pytorch.org/models/alexnet-owt-7be5be79.pth) into " \
           f"{hub / 'hub' / 'checkpoints'}" in sentence
    assert "CalledProcessError" not in result.stderr and "subprocess" not in result.stderr


def test_a_wrong_flag_is_one_line(tiny_model, tmp_path):
    result = train(["--learnig_rate", "1e-4"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2
    assert lines == ["error: unrecognized arguments: --learnig_rate 1e-4; see `python -m stabletune_core train "
                     "--help` for every flag."], result.stderr


def test_nan_learning_rate_is_not_a_number():
    with pytest.raises(ConfigError) as caught:
        build_config({"learning_rate": float("nan")})
    assert caught.value.problems == ["learning_rate is not a number (NaN); give a number."]


def test_unexpected_errors_are_one_line_and_the_traceback_goes_to_a_file(tiny_model, shapes_dataset, tmp_path):
    code = ("import sys\nfrom stabletune_core.train import setup\n"
            "def broken(config, report):\n    raise KeyError('surprise')\n"
            "setup.find_resume_checkpoint = broken\nfrom stabletune_core.cli import main\nsys.exit(main(['train', *sys.argv[1:]]))")
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, shapes_dataset, run), entry=[sys.executable, "-c", code])
    sentence = assert_failed(result, run, "internal error: KeyError: 'surprise'; please report it", code=1)
    assert str(run / "traceback.txt") in sentence
    assert "KeyError" in (run / "traceback.txt").read_text()


def test_a_ctrl_c_after_the_stopped_run_is_saved_exits_quietly():
    """The second Ctrl-C can land after the run saved and gave its handlers back (the interpreter exiting):
    it must end the process with the stop's code, not raise KeyboardInterrupt into the exit."""
    script = textwrap.dedent("""
        import os, signal, time
        from stabletune_core.train.signals import StopSignals
        stop = StopSignals().install()
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: the run stops and saves
        stop.restore()                       # the CLI gives the handlers back after the run
        os.kill(os.getpid(), signal.SIGINT)  # the second one, while the process is on its way out
        time.sleep(5)
        print("still running")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "still running" not in proc.stdout
