#!/usr/bin/env bash
# The checks that need a CUDA GPU, in sections, with a results table written to bench/RESULTS.md (between the
# gpu_check markers; the rest of the file is left alone). A lent GPU comes with 14 minutes of device time in all, so
# the default sections' limits add up to 12.5 minutes; the others run on a second lease, named with --sections.
#
#   bash bench/gpu_check.sh                                   # the default sections (<= 750 s)
#   bash bench/gpu_check.sh --sections z_image_12gb,sdxl_6gb  # only these
#   bash bench/gpu_check.sh --sections rest                   # the sections the default leaves out (<= 400 s)
#   bash bench/gpu_check.sh --list                            # every section, its limit, whether default
#
# The sections, each under its own time limit (seconds):
#   tests                 150  default  the tests that skip without CUDA: sampling leaves no VRAM behind, the real
#                                       fp16 overflow -> bf16/fp32 fallback, preflight's largest micro-batch,
#                                       cached-away modules off the GPU (pytest)
#   klein_4b              100  default  bench/klein_gpu.py: the real FLUX.2 Klein 4B transformer (random weights from
#                                       the shipped config), bf16 + GC, LoRA rank 16, at 512 and 1024 px: it/s, peak
#                                       VRAM, largest batch, beside the memory model's estimate (the 12 GB preset)
#   klein_4b_int8          60  default  the 4B's 8 GB plan (int8; issue 36.5) at 512 and 1024 px beside its estimate
#   klein_9b_int8_swap10  130  default  the 9B's 12 GB plan (int8 + 10 blocks swapped) at 512 and 1024 px
#   klein_4b_bnb_nf4       60  default  the 4B with diffusers' example's 4-bit base (bitsandbytes nf4): it/s and
#                                       peak beside our nf4 (klein_4b_nf4); skipped in one line without bitsandbytes
#   sdxl_6gb               70  default  bench/plan_gpu.py: the real SDXL UNet in its 6 GB plan (issue 36.5)
#   z_image_12gb           90  default  bench/plan_gpu.py: the real Z-Image transformer (6.15 B) in its 12 GB plan
#                                       (int8) at 512 and 1024 px beside the estimate (issue 39.6)
#   z_image_16gb           80  default  the same in its 16 GB plan (bf16)
#   klein_4b_nf4           50  rest     the 4B with our nf4 base, the row beside bitsandbytes' (same settings)
#   klein_9b_nf4_swap16   120  rest     the 9B's 8 GB plan (nf4 + 16 blocks swapped) at 1024 px
#   compare_peer          130  rest     bench/compare_peer.py --gpu: it/s, peak VRAM, largest batch at 512 px (SD 1.5)
#   cache_memory          100  rest     bench/cache_memory.py: peak VRAM and time to step 1 with caches
#   klein_4b_peer         240  only when KLEIN_PEER_SCRIPT names diffusers' train_dreambooth_lora_flux2_klein.py
#                                       (and KLEIN_PEER_PYTHONPATH, if given, a folder with its `datasets`) and the
#                                       section is named: klein_4b also writes the random 4B as a diffusers folder,
#                                       and bench/transformer_peer.py runs StableTune and the example on it at 512 px,
#                                       batch 1, bf16 + GC, rank 16: first step, s/step, peak CUDA memory, ratios
#
# Which Python: $PYTHON if set, else .venv/bin/python when it exists, else python3. It needs the packages of
# requirements.txt (a CUDA build of torch) and pytest; nothing is installed by this script. To use a fresh
# environment instead: python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements.txt pytest,
# then PYTHON=.venv-gpu/bin/python bash bench/gpu_check.sh.
#
# On a machine without CUDA it prints one line and exits 0 (after checking the section names). Exit status: 0 when
# every check that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."

# name limit group (default / rest / peer)
SECTIONS="tests 150 default
klein_4b 100 default
klein_4b_int8 60 default
klein_9b_int8_swap10 130 default
klein_4b_bnb_nf4 60 default
sdxl_6gb 70 default
z_image_12gb 90 default
z_image_16gb 80 default
klein_4b_nf4 50 rest
klein_9b_nf4_swap16 120 rest
compare_peer 130 rest
cache_memory 100 rest
klein_4b_peer 240 peer"

WANTED=$(awk '$3 == "default" {print $1}' <<< "$SECTIONS")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --list) echo "$SECTIONS" | column -t; exit 0 ;;
    --sections) WANTED=$(tr ',' '\n' <<< "${2:-}"); shift 2 ;;
    --sections=*) WANTED=$(tr ',' '\n' <<< "${1#--sections=}"); shift ;;
    *) echo "gpu_check: unknown argument '$1'; use --sections a,b (see --list)." >&2; exit 2 ;;
  esac
done
if [[ "$WANTED" == "rest" ]]; then WANTED=$(awk '$3 == "rest" {print $1}' <<< "$SECTIONS"); fi
if [[ "$WANTED" == "all" ]]; then WANTED=$(awk '$3 != "peer" {print $1}' <<< "$SECTIONS"); fi
for name in $WANTED; do
  if ! awk -v n="$name" '$1 == n {found=1} END {exit !found}' <<< "$SECTIONS"; then
    echo "gpu_check: there is no section '$name'; the sections are: $(awk '{print $1}' <<< "$SECTIONS" | paste -sd, -)." >&2
    exit 2
  fi
done
wanted() { grep -qx "$1" <<< "$WANTED"; }
limit() { awk -v n="$1" '$1 == n {print $2}' <<< "$SECTIONS"; }

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: a GPU is here but $PY has no CUDA-enabled torch; set PYTHON to one that has." >&2
    exit 2
  fi
  echo "gpu_check: no CUDA device here, so there is nothing to check (run it on a GPU machine)."
  exit 0
fi

GPU_TESTS=(
  tests/test_guards.py::test_sampling_does_not_leak_vram
  tests/test_guards.py::test_fp16_divergence_falls_back_and_finishes_finite
  tests/test_guards.py::test_preflight_finds_the_largest_micro_batch_on_gpu
  tests/test_cache.py::test_cached_away_modules_leave_the_gpu_and_sampling_brings_the_vae_back
)

OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       STABLETUNE_CACHE="$OUT/cache"
: > "$OUT/steps"

check() {  # check NAME SECONDS COMMAND...: run it under a time limit, keep its log, record status and time
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "gpu_check: $name (at most ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name $rc $(( $(date +%s) - t0 ))" >> "$OUT/steps"
  tail -n 15 "$OUT/$name.log"
}

wanted tests && check tests "$(limit tests)" "$PY" -m pytest -q -rA -p no:cacheprovider \
  --junitxml="$OUT/tests.xml" "${GPU_TESTS[@]}"
KLEIN_MODEL=() KLEIN_LIMIT=$(limit klein_4b)
if [[ -n "${KLEIN_PEER_SCRIPT:-}" ]] && wanted klein_4b_peer; then  # writing the random 4B (16 GB): a minute more
  KLEIN_MODEL=(--write-model "$OUT/klein-4b") KLEIN_LIMIT=$((KLEIN_LIMIT + 60))
fi
wanted klein_4b && check klein_4b "$KLEIN_LIMIT" "$PY" bench/klein_gpu.py --device cuda --resolutions 512,1024 \
  --steps 5 --max-batch 16 --budget-s 20 ${KLEIN_MODEL[@]+"${KLEIN_MODEL[@]}"}
# issue 36: the memory plans of the 8 GB (4B), 12 GB and 8 GB (9B) targets, measured beside their estimate
wanted klein_4b_int8 && check klein_4b_int8 "$(limit klein_4b_int8)" "$PY" bench/klein_gpu.py --device cuda \
  --variant 4b --base-storage int8 --resolutions 512,1024 --steps 3 --max-batch 1 --budget-s 5
wanted klein_9b_int8_swap10 && check klein_9b_int8_swap10 "$(limit klein_9b_int8_swap10)" "$PY" \
  bench/klein_gpu.py --device cuda --variant 9b --base-storage int8 --blocks-to-swap 10 --resolutions 512,1024 \
  --steps 3 --max-batch 1 --budget-s 5
# diffusers' example at its 4-bit setting (bitsandbytes nf4), beside our nf4 on the same 4B, 1024 px
if wanted klein_4b_bnb_nf4; then
  if "$PY" -c 'import bitsandbytes' >/dev/null 2>&1; then
    check klein_4b_bnb_nf4 "$(limit klein_4b_bnb_nf4)" "$PY" bench/klein_gpu.py --device cuda --variant 4b \
      --bnb-nf4 --resolutions 1024 --steps 5 --max-batch 1 --budget-s 5
  else
    echo "gpu_check: klein_4b_bnb_nf4 skipped: bitsandbytes is not installed for $PY (pip install bitsandbytes)."
  fi
fi
wanted klein_4b_nf4 && check klein_4b_nf4 "$(limit klein_4b_nf4)" "$PY" bench/klein_gpu.py --device cuda \
  --variant 4b --base-storage nf4 --resolutions 1024 --steps 5 --max-batch 1 --budget-s 5
wanted klein_9b_nf4_swap16 && check klein_9b_nf4_swap16 "$(limit klein_9b_nf4_swap16)" "$PY" bench/klein_gpu.py \
  --device cuda --variant 9b --base-storage nf4 --blocks-to-swap 16 --resolutions 1024 --steps 3 --max-batch 1 \
  --budget-s 5
# issue 36.5 and 39.6: SDXL's 6 GB plan and Z-Image's 12 and 16 GB plans on the real sizes, beside their estimate
wanted sdxl_6gb && check sdxl_6gb "$(limit sdxl_6gb)" "$PY" bench/plan_gpu.py --family sdxl --plan-gb 6 \
  --resolutions 512,1024 --steps 3
wanted z_image_12gb && check z_image_12gb "$(limit z_image_12gb)" "$PY" bench/plan_gpu.py --family z_image \
  --plan-gb 12 --resolutions 512,1024 --steps 3
wanted z_image_16gb && check z_image_16gb "$(limit z_image_16gb)" "$PY" bench/plan_gpu.py --family z_image \
  --plan-gb 16 --resolutions 512,1024 --steps 3
wanted compare_peer && check compare_peer "$(limit compare_peer)" "$PY" bench/compare_peer.py --gpu --max_batch 128
wanted cache_memory && check cache_memory "$(limit cache_memory)" "$PY" bench/cache_memory.py
if [[ -n "${KLEIN_PEER_SCRIPT:-}" ]] && wanted klein_4b_peer; then
  check klein_4b_peer "$(limit klein_4b_peer)" "$PY" bench/transformer_peer.py --peer-script "$KLEIN_PEER_SCRIPT" \
    ${KLEIN_PEER_PYTHONPATH:+--peer-pythonpath "$KLEIN_PEER_PYTHONPATH"} --model "$OUT/klein-4b" --rows same,peer \
    --resolution 512 --batch 1 --rank 16 --precision bf16 --gradient-checkpointing --steps 15 --rounds 1 \
    --threads 8 --out "$OUT/klein-peer"
fi

"$PY" - "$OUT" bench/RESULTS.md <<'EOF'
"""Turn the logs of this run into the gpu_check section of bench/RESULTS.md."""
import datetime
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, results = Path(sys.argv[1]), Path(sys.argv[2])
steps = [line.split() for line in (out / "steps").read_text().splitlines()]
rows = ["| check | result | seconds |", "|---|---|---|"]
for name, rc, seconds in steps:
    verdict = "pass" if rc == "0" else ("TIMED OUT" if rc in ("124", "137") else f"FAIL (exit {rc})")
    rows.append(f"| {name} | {verdict} | {seconds} |")
tests = ["| test | outcome | seconds |", "|---|---|---|"]
if (out / "tests.xml").exists():
    for case in ET.parse(out / "tests.xml").iter("testcase"):
        outcome = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
        tests.append(f"| {case.get('classname')}::{case.get('name')} | {outcome} | {float(case.get('time', 0)):.1f} |")


def table_of(name):
    log = out / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    keep = [l for l in text.splitlines() if not re.match(r"^(round|gpu_check|\s*$)", l)]
    return "\n".join(keep[-12:])


stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
section = "\n".join([
    "<!-- gpu_check:start -->",
    f"## GPU checks ({torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp})",
    "", "Written by `bash bench/gpu_check.sh`.", "", *rows, "", *tests, "",
    "### compare_peer.py --gpu", "```", table_of("compare_peer"), "```", "",
    "### cache_memory.py", "```", table_of("cache_memory"), "```", "",
    "### klein_gpu.py (FLUX.2 Klein 4B)", "```", table_of("klein_4b"), "```", "",
    "### klein_gpu.py, the memory plans (FLUX.2 Klein 4B int8; 9B int8 + 10 blocks swapped, nf4 + 16; issue 36)",
    "```", table_of("klein_4b_int8"), table_of("klein_9b_int8_swap10"), table_of("klein_9b_nf4_swap16"), "```", "",
    "### klein_gpu.py, the 4B's 4-bit base: bitsandbytes nf4 (diffusers' example) beside ours", "```",
    table_of("klein_4b_bnb_nf4"), table_of("klein_4b_nf4"), "```", "",
    "### plan_gpu.py, the memory plans (SDXL 6 GB; Z-Image 12 and 16 GB; issues 36.5, 39.6)", "```",
    table_of("sdxl_6gb"), table_of("z_image_12gb"), table_of("z_image_16gb"), "```",
    *(["", "### transformer_peer.py (StableTune vs diffusers' Klein example on the random 4B)", "```",
       table_of("klein_4b_peer"), "```"] if (out / "klein_4b_peer.log").exists() else []),
    "<!-- gpu_check:end -->", ""])
old = results.read_text() if results.exists() else "# Benchmark results\n\n"
pattern = re.compile(r"<!-- gpu_check:start -->.*?<!-- gpu_check:end -->\n?", re.S)
results.write_text(pattern.sub(lambda m: section, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + section)
print(f"gpu_check: results in {results}")
EOF

failed=$(awk '$2 != 0' "$OUT/steps" | wc -l)
echo "gpu_check: $(( $(wc -l < "$OUT/steps") - failed )) of $(wc -l < "$OUT/steps") checks passed; logs in $OUT"
[[ $failed -eq 0 ]]
