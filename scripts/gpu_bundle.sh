#!/usr/bin/env bash
# Prepare what scripts/gpu_evidence.py needs on a GPU machine that can reach nothing outside
# (docs/gpu.md), into .gpu/ (ignored by git), for the machine's Python (3.12 by default):
#   .gpu/whl/           megatron-core 0.17.1's wheel
#   .gpu/Megatron-LM/   Megatron-LM core_v0.17.1's pretrain_gpt.py with what it imports
#   .gpu/whl019/        megatron-core 0.19.2's wheel (gpu_evidence.py's part mcore019)
#   .gpu/Megatron-LM-019/  Megatron-LM core_v0.19.0's pretrain_gpt.py with what it imports
#
#   scripts/gpu_bundle.sh [PYTHON_VERSION]       # then, on the GPU machine, docs/gpu.md's command
#
# MEGATRON_LM_GIT: a Megatron-LM git clone (required; docs/development.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pyver=${1:-3.12}
git_dir=${MEGATRON_LM_GIT:-}
[[ -n $git_dir && -d $git_dir ]] || { echo "gpu_bundle: set MEGATRON_LM_GIT to a Megatron-LM git clone (got '$git_dir')" >&2; exit 1; }
exclude=$(git -C "$root" rev-parse --path-format=absolute --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo '/.gpu/' >> "$exclude"; }
rm -rf "$root/.gpu" && mkdir -p "$root/.gpu/whl" "$root/.gpu/whl019" "$root/.gpu/Megatron-LM" \
  "$root/.gpu/Megatron-LM-019"
wheel() {  # version, folder
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$root/.gpu/$2" "megatron-core==$1"
}
wheel 0.17.1 whl
wheel 0.19.2 whl019
git --git-dir "$git_dir" archive core_v0.17.1 pretrain_gpt.py gpt_builders.py model_provider.py \
  megatron/legacy | tar -x -C "$root/.gpu/Megatron-LM"
# core_v0.19.0 has no megatron/legacy; megatron.training is in megatron-core 0.19.2's wheel
git --git-dir "$git_dir" archive core_v0.19.0 pretrain_gpt.py gpt_builders.py model_provider.py \
  | tar -x -C "$root/.gpu/Megatron-LM-019"
du -sh "$root/.gpu"/*
du -sh "$root/.gpu"
