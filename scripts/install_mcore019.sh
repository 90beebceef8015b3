#!/usr/bin/env bash
# Install megatron-core 0.19.2 into VENV/mcore019 for this machine's Python 3.11 (called by
# scripts/bootstrap.sh; run on its own to rebuild that folder only).
#
# megatron-core 0.19.2 ships one wheel, cp312. Its Python code runs on 3.11 but for two things:
# - typing.override (new in 3.12) in megatron/training/models/{gpt,hybrid}.py: taken from
#   typing_extensions instead (patches/megatron-core-0.19.2-py311.patch);
# - the only compiled part, the dataset helpers: built here for this Python from the
#   helpers.cpp the wheel ships beside them, with pybind11 and the system's C++ compiler.
# Its pipeline schedules import triton (which torch's CPU wheel does not bring): triton's
# 3.11 wheel goes in the same folder (about 1 GB unpacked; nothing here runs a triton kernel).
# The folder is built beside the old one and swapped in whole, so a failed run leaves no half.
set -euo pipefail
venv=${1:?usage: install_mcore019.sh VENV}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="$venv/bin/python"
dest="$venv/mcore019"
tmp="$dest.partial"
rm -rf "$tmp" "$venv/.pybind11"
pip=("$py" -m pip install -q --no-deps --target)
"${pip[@]}" "$tmp" --python-version 3.12 --only-binary=:all: megatron-core==0.19.2
"${pip[@]}" "$tmp" triton==3.9.0
"${pip[@]}" "$venv/.pybind11" pybind11==3.1.0
patch -s -p1 -d "$tmp" < "$root/patches/megatron-core-0.19.2-py311.patch"
datasets="$tmp/megatron/core/datasets"
rm -f "$datasets"/helpers_cpp.cpython-3*.so
read -r includes suffix < <("$py" -c "import sys, sysconfig; sys.path.insert(0, '$venv/.pybind11')
import pybind11
print('-I' + sysconfig.get_paths()['include'] + ',-I' + pybind11.get_include(),
      sysconfig.get_config_var('EXT_SUFFIX'))")
${CXX:-g++} -O3 -shared -std=c++17 -fPIC ${includes//,/ } "$datasets/helpers.cpp" \
  -o "$datasets/helpers_cpp$suffix"
rm -rf "$venv/.pybind11" "$dest"
mv "$tmp" "$dest"
