#!/usr/bin/env bash
# Prepare `.gpu/` for a run of benchmarks/gpu_check.sh on the GPU machine (no package registry there):
# the team's ../shared/gpu/carry.sh (DeepSpeed, pydantic, typer, fastapi, ...), then the `openai`
# client the serve flow talks through, with the dependencies that machine lacks (and fastapi's
# opentelemetry-api, which carry.sh leaves out).
#
#   . .venv/bin/activate && bash benchmarks/gpu_prepare.sh
#   # there: source .gpu/env.sh && bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/carry.sh
version() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels=()
for pkg in openai httpx2 httpcore2 truststore jiter sniffio distro opentelemetry-api; do
  v=$(version "$pkg" 2>/dev/null) || continue
  wheels+=("$pkg==$v")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "${wheels[@]}" 2>&1 | grep -v '^WARNING' || true
echo "added the openai client: $(ls .gpu/whl | wc -l) wheels in .gpu/whl"
