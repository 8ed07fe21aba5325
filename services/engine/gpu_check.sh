#!/usr/bin/env bash
# Runs the SGLang GPU check (services/engine/gpu_check.py) on a machine with a GPU and sglang.
#   bash services/engine/gpu_check.sh [model: tiny-qwen | smollm2 | HF folder] [report.json]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import sglang" 2>/dev/null; then
  echo "sglang is not importable with $PY; install it (pip install sglang==0.5.23) on the GPU machine" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" -m services.engine.gpu_check --model "${1:-tiny-qwen}" --out "${2:-gpu_check.json}"
