#!/usr/bin/env bash
# Prepare what scripts/gpu_evidence.py needs on a GPU machine that can reach nothing outside
# (docs/gpu.md): megatron-core 0.17.1's wheel for the machine's Python (3.12 by default) and
# Megatron-LM core_v0.17.1's pretrain_gpt.py with what it imports, into .gpu/ (ignored by git).
#
#   scripts/gpu_bundle.sh [PYTHON_VERSION]       # then, on the GPU machine, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
#   PYTHONPATH=/tmp/site python3 scripts/gpu_evidence.py --megatron-lm .gpu/Megatron-LM --out OUT
#
# MEGATRON_LM_GIT: a Megatron-LM git clone (default: the tests' mirror path).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pyver=${1:-3.12}
git_dir=${MEGATRON_LM_GIT:-/work/.mirror/NVIDIA+Megatron-LM/repo}
[[ -d $git_dir ]] || { echo "gpu_bundle: no Megatron-LM git clone at $git_dir (set MEGATRON_LM_GIT)" >&2; exit 1; }
exclude=$(git -C "$root" rev-parse --path-format=absolute --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo '/.gpu/' >> "$exclude"; }
rm -rf "$root/.gpu" && mkdir -p "$root/.gpu/whl" "$root/.gpu/Megatron-LM"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$root/.gpu/whl" megatron-core==0.17.1
git --git-dir "$git_dir" archive core_v0.17.1 pretrain_gpt.py gpt_builders.py model_provider.py \
  megatron/legacy | tar -x -C "$root/.gpu/Megatron-LM"
du -sh "$root/.gpu"/*
