"""bench/transformer_peer.py without the peer (issue 23 item 6; named klein_peer.py until it ran Z-Image too): its
StableTune command lines are what StableTune's own parser reads as the shared setting, the example's carry the same
values, the probe's times (with peak memory) are read back by bench/first_step.py's `timed`, and a StableTune-only
run of the bench ends in a table."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench, parsed_by_stabletune

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "transformer_peer.py"


bench = load_bench("transformer_peer")
SETTING = bench.Setting(steps=23, rank=6, learning_rate=3e-4, batch=2, resolution=128, seed=7, precision="bf16",
                        gradient_checkpointing=True)


@pytest.mark.parametrize("same_work", [True, False])
def test_stabletune_rows_run_the_shared_setting(tmp_path, same_work):
    config = parsed_by_stabletune(bench.stabletune_command(tmp_path / "model", tmp_path / "data", tmp_path / "run",
                                                           SETTING, same_work))
    assert (config.model_family, config.max_train_steps, config.lora_rank, config.effective_lora_alpha) == \
        ("flux2_klein", 23, 6, 6.0)
    assert (config.learning_rate, config.train_batch_size, config.resolution, config.seed) == (3e-4, 2, 128, 7)
    assert config.mixed_precision == "bf16" and config.gradient_checkpointing
    assert config.unet_lora_targets == bench.KLEIN.targets()
    assert config.save_steps > 10 ** 5  # no snapshots inside the timed steps
    caches = (config.cache_latents, config.cache_text_embeddings)
    assert caches == ((True, True) if same_work else (False, False))
    if same_work:  # what the example does not do, off
        assert not config.validation_prompt and config.validation_loss_every == 0 and config.validation_split == 0


def test_the_example_gets_the_same_values_and_the_pipelines_text_layers(tmp_path):
    command = bench.peer_command(tmp_path / "train.py", tmp_path / "model", tmp_path / "peer-data", tmp_path / "run",
                                 SETTING)
    flags: dict[str, list[str]] = {}
    for word in command[1:]:
        if word.startswith("--"):
            flags[word] = []
            current = flags[word]
        else:
            current.append(word)
    assert command[0] == str(tmp_path / "train.py")
    expected = {"--max_train_steps": ["23"], "--rank": ["6"], "--lora_alpha": ["6"], "--learning_rate": ["0.0003"],
                "--train_batch_size": ["2"], "--resolution": ["128"], "--seed": ["7"], "--mixed_precision": ["bf16"],
                "--gradient_checkpointing": [], "--caption_column": ["text"],
                "--dataset_name": [str(tmp_path / "peer-data")], "--text_encoder_out_layers": ["9", "18", "27"]}
    assert {k: flags[k] for k in expected} == expected
    assert int(flags["--checkpointing_steps"][0]) > 10 ** 5
    # the example's default LoRA targets are StableTune's preset "diffusers_default"
    assert bench.KLEIN.targets()[:4] == ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]


def test_probe_times_give_first_step_pace_and_peak_memory(tmp_path):
    """bench/step_probe.py around a real optimizer loop, read back by first_step.timed (as the bench runs it)."""
    trainer = tmp_path / "trainer.py"
    trainer.write_text("import torch\nw = torch.nn.Parameter(torch.zeros(4))\nopt = torch.optim.SGD([w], lr=0.1)\n"
                       "keep = torch.ones(16 * 2 ** 20)  # 64 MiB resident\n"
                       "for _ in range(12):\n    (w - 1).pow(2).sum().backward(); opt.step(); opt.zero_grad()\n")
    env = bench.thread_env(1)
    result = bench.timed([str(trainer)], env, tmp_path / "t.times", tmp_path / "t.log", 12)
    assert 0 < result["first_step_s"] <= result["step10_s"] <= result["last_step_s"]
    assert result["sec_per_step"] >= 0 and result["peak_cuda_mib"] == 0
    assert result["peak_rss_mib"] > 64
    assert len((tmp_path / "t.times").read_text().split("\n")[0].split()) == 4


def test_rounds_alternate_and_the_table_divides_by_the_example():
    assert bench.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    run = lambda first, per, rss: {"first_step_s": first, "step10_s": 0, "last_step_s": 0,  # noqa: E731
                                   "sec_per_step": per, "peak_rss_mib": rss, "peak_cuda_mib": 0.0, "load": 1.0}
    table = bench.markdown_table({bench.ROW_SAME_WORK: [run(10, 0.2, 800), run(12, 0.4, 900)],
                                  bench.ROW_PEER: [run(20, 0.3, 1000), run(20, 0.3, 1000)]}, 40)
    same = next(line for line in table.splitlines() if line.startswith(f"| {bench.ROW_SAME_WORK}"))
    assert same.split(" | ")[1:7] == ["11.0", "0.300", "850", "0.55", "1.00", "0.85"]
    assert "peak RSS (MiB)" in table


def test_bad_arguments_get_one_sentence_before_anything_runs(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    for argv, words in ((["--out", str(tmp_path / "out")], "not empty"),
                        (["--out", str(tmp_path / "new"), "--peer-script", str(tmp_path / "nope.py")], "not a file"),
                        (["--out", str(tmp_path / "new"), "--model", str(tmp_path)], "model_index.json"),
                        (["--out", str(tmp_path / "new"), "--steps", "10"], "above 10")):
        with pytest.raises(SystemExit, match=words):
            bench.check_args(bench.parse_args(argv))
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep" and not (tmp_path / "new").exists()
    assert bench.parse_args(["--out", "x"]).rows == ["same", "defaults"]  # no peer script: its row is left out


def test_a_stabletune_only_bench_run_ends_in_a_table(tmp_path):
    """The bench end to end on the tiny Klein, the peer left out (about 20 s on one idle core)."""
    done = subprocess.run([sys.executable, str(BENCH), "--steps", "11", "--rounds", "1", "--threads", "1", "--rows",
                           "same", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith(f"| {bench.ROW_SAME_WORK}"))
    first, per, rss = (float(x) for x in line.split(" | ")[1:4])
    assert first > 0 and per > 0 and rss > 100


def test_model_toy_is_the_toy_klein_base_or_one_sentence():
    """`--model toy`: the toy Klein base's folder where the checkout ships it, else one sentence."""
    try:
        folder = bench.toy_klein_base()
    except SystemExit as exc:
        assert "toy Klein base is not in this checkout" in str(exc) and "\n" not in str(exc)
    else:
        assert (folder / "model_index.json").is_file()


def bench_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """bench module -> the bench modules it imports, at its top or inside a function (a lazy import is an arrow too)."""
    import ast

    arrows = {}
    for name, text in sources.items():
        found = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        arrows[name] = found & set(sources) - {name}
    return arrows


def import_circle(arrows: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules in order, the first repeated at the end), or [] when there is none."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        state[name] = "open"
        for other in sorted(arrows[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [name, other] if other in path else [name, other]
            if other not in state:
                circle = visit(other, path + [name])
                if circle:
                    return circle
        state[name] = "done"
        return []

    for name in sorted(arrows):
        if name not in state:
            circle = visit(name, [])
            if circle:
                return circle
    return []


def test_the_benches_import_one_another_without_a_circle():
    """first_step -> toy_quality -> transformer_peer -> first_step was a circle (toy_quality took the peer bench's
    Setting and peer_command, the peer bench toy_quality's data helpers): the examples' commands live in
    bench/transformer_example.py, which both import."""
    assert import_circle(bench_imports({"a": "import b", "b": "def f():\n    from c import x", "c": "from a import y"}))
    assert not import_circle(bench_imports({"a": "import b", "b": "import c", "c": "import os"}))
    sources = {p.stem: p.read_text(encoding="utf-8") for p in (ROOT / "bench").glob("*.py")}
    assert not import_circle(bench_imports(sources)), import_circle(bench_imports(sources))


def test_z_image_rows_run_its_family_and_the_examples_default_targets(tmp_path):
    """`--family z_image` (issue 39 item 6): StableTune's rows train Z-Image on the example's default targets (every
    attention's to_q/to_k/to_v/to_out.0: StableTune's "attention" preset), the example gets no Klein-only flag."""
    z_image = bench.FAMILIES["z_image"]
    config = parsed_by_stabletune(bench.stabletune_command(tmp_path / "model", tmp_path / "data", tmp_path / "run",
                                                           SETTING, True, z_image))
    assert config.model_family == "z_image" and config.max_train_steps == 23
    assert config.unet_lora_targets == z_image.targets()
    assert sorted(t.rsplit(".", 1)[-1] if not t.endswith("out.0") else "to_out.0" for t in z_image.targets()) == \
        ["to_k", "to_out.0", "to_q", "to_v"]  # the example's default list
    command = bench.peer_command(tmp_path / "train.py", tmp_path / "model", tmp_path / "peer-data", tmp_path / "run",
                                 SETTING, family=z_image)
    assert "--text_encoder_out_layers" not in command and command[command.index("--rank") + 1] == "6"
    with pytest.raises(SystemExit, match="train_dreambooth_lora_z_image.py"):
        bench.check_args(bench.parse_args(["--family", "z_image", "--out", str(tmp_path / "new"),
                                           "--peer-script", str(tmp_path / "nope.py")]))
    with pytest.raises(SystemExit, match="toy Klein base"):
        bench.check_args(bench.parse_args(["--family", "z_image", "--out", str(tmp_path / "new"), "--model", "toy"]))


def test_a_z_image_bench_run_builds_its_tiny_model_and_ends_in_a_table(tmp_path):
    """The bench end to end on the tiny real-layout Z-Image, the peer left out."""
    done = subprocess.run([sys.executable, str(BENCH), "--family", "z_image", "--steps", "11", "--rounds", "1",
                           "--threads", "1", "--rows", "same", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "tiny-z_image" / "model_index.json").is_file()
    line = next(l for l in done.stdout.splitlines() if l.startswith(f"| {bench.ROW_SAME_WORK}"))
    first, per, rss = (float(x) for x in line.split(" | ")[1:4])
    assert first > 0 and per > 0 and rss > 100


def test_the_bench_is_named_for_every_transformer_family_and_asks_the_family_for_its_targets():
    """Review: the peer bench, then named klein_peer.py, ran Z-Image too (`--family z_image`), so its name lied; and
    its example_targets(family) only forwarded to PeerFamily.targets(). The old name stays only where it is history
    ("then named ...": bench/RESULTS.md's quoted commands)."""
    old = "klein" + "_peer"  # spelled apart, so this file is no mention of it
    assert BENCH.is_file() and not (ROOT / "bench" / f"{old}.py").exists()
    assert not hasattr(bench, "example_targets")
    assert bench.FAMILIES["z_image"].targets() != bench.KLEIN.targets()
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench").rglob("*"),
              *(ROOT / "tests").rglob("*.py"), *(ROOT / "stabletune_core").rglob("*.py")]
    current = []
    for path in places:
        if path.suffix not in (".py", ".md", ".sh", ".toml") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        at = text.find(old)
        while at >= 0:
            if "named" not in text[max(0, at - 30):at].lower():
                current.append(f"{path.relative_to(ROOT)}: ...{text[max(0, at - 30):at + 20]!r}")
            at = text.find(old, at + 1)
    assert not current, current
