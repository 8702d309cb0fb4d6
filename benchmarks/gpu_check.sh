#!/usr/bin/env bash
# Every user flow on a CUDA machine, then the GPU benchmarks; one summary line at the end.
#
#   bash benchmarks/gpu_check.sh [--budget SECONDS]      (default 345: the whole check, under 6 minutes)
#
# Flows: the README's main job (`mseq train`, default flags), `mseq validate`, `mseq generate`,
# `mseq serve` answering the openai client, `mseq export hf` loading in transformers with equal
# logits, a resume, ZeRO-1/2/3 under the deepspeed launcher on all GPUs (TP=2 when there are 2);
# then `benchmarks.train`, `benchmarks/generate.py`, `benchmarks/zero0_step.py`, `benchmarks/vocab_padding.py` and `benchmarks/profile_train.py` at OPT-1.3b's shape in bf16 (MFU against the
# measured bf16 matmul peak). Details and timeouts: benchmarks/gpu_check.py. On a machine without
# CUDA it checks its own syntax, says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
python=$(command -v python3 || command -v python)
bash -n "$0" && "$python" -m py_compile benchmarks/gpu_check.py || exit 1
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here: syntax checked, nothing run"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
exec "$python" -m benchmarks.gpu_check "$@"
