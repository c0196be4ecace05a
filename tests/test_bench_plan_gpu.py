"""bench/gpu_check.sh's new sections without a GPU (issue 39.6, issue 36.5): bench/plan_gpu.py's whole code path as a
dry run on the tiny Z-Image and SDXL on the CPU (the plan's storage, the training step, the table), klein_gpu.py's
bitsandbytes row refused in one sentence where it cannot run, and the script's sections: the default ones fit the
14 minutes a lent GPU has, each names an entry that exists, and a wrong name is one sentence."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def sections() -> dict[str, tuple[int, str]]:
    block = re.search(r'SECTIONS="(.*?)"', SCRIPT.read_text(), re.S).group(1)
    return {name: (int(limit), group) for name, limit, group in (line.split() for line in block.splitlines())}


@pytest.mark.parametrize("family, storage", [("z_image", "int8"), ("sdxl", "int8")])
def test_plan_gpu_runs_dry_on_the_cpu_with_the_plans_storage(family, storage, tmp_path):
    """--plan-gb stores the base as the plan for that card chooses (planned at the real size), and the step trains."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_gpu.py"), "--family", family, "--device", "cpu",
                           "--tiny", "--plan-gb", "6" if family == "sdxl" else "12", "--resolutions", "64",
                           "--steps", "1", "--json", str(tmp_path / "rows.json")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["family"] == family and row["base_storage"] == storage and row["loss"] > 0 and row["it_per_s"] > 0
    assert f"base {storage}, the" in done.stdout and "| 64 | 1 |" in done.stdout
    assert done.stdout.startswith("Memory plan for ")  # the plan's own sentence, as a run prints it


def test_plan_gpu_and_the_bitsandbytes_row_refuse_what_they_cannot_do_in_one_sentence():
    cases = [(["plan_gpu.py", "--family", "z_image", "--device", "cpu", "--plan-gb", "12"], "add --tiny"),
             (["plan_gpu.py", "--family", "sdxl", "--tiny", "--device", "cpu"], "Give either --plan-gb"),
             (["klein_gpu.py", "--device", "cpu", "--tiny", "--bnb-nf4", "--resolutions", "64"], "--bnb-nf4 "),
             (["klein_gpu.py", "--bnb-nf4", "--base-storage", "int8"], "leave --base-storage at full")]
    for argv, words in cases:
        done = subprocess.run([sys.executable, str(ROOT / "bench" / argv[0]), *argv[1:]], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode != 0 and words in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert len(done.stderr.strip().splitlines()[-1].split(". ")) <= 2  # one sentence


def test_the_default_sections_fit_a_lent_gpu_and_each_runs_an_entry_that_exists():
    table = sections()
    default = {name for name, (_, group) in table.items() if group == "default"}
    assert sum(table[name][0] for name in default) <= 13 * 60  # 14 minutes a lease, a minute to start
    assert {"z_image_12gb", "z_image_16gb", "sdxl_6gb", "klein_4b_int8", "klein_4b_bnb_nf4"} <= default
    text = SCRIPT.read_text()
    for name in table:
        assert f"wanted {name}" in text, name  # every section is run by its name
    for entry in set(re.findall(r"bench/(\w+\.py)", text)):
        assert (ROOT / "bench" / entry).is_file(), entry
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    wrong = subprocess.run(["bash", str(SCRIPT), "--sections", "z_image_12gb,nope"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "there is no section 'nope'" in wrong.stderr
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True)
    assert listed.returncode == 0 and "z_image_12gb" in listed.stdout
