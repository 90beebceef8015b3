#!/usr/bin/env bash
# Install megatron-core 0.19.2 as VENV's own megatron-core on this machine's Python 3.11 (called
# by scripts/bootstrap.sh; run on its own to reinstall it only). On Python 3.12,
# `pip install megatron-core==0.19.2` does the same; this script exists for the 3.11 CPU stack.
#
# megatron-core 0.19.2 ships one wheel, cp312. Its Python code runs on 3.11 but for two things:
# - typing.override (new in 3.12) in megatron/training/models/{gpt,hybrid}.py: taken from
#   typing_extensions instead (patches/megatron-core-0.19.2-py311.patch);
# - the only compiled part, the dataset helpers: built here for this Python from the
#   helpers.cpp the wheel ships beside them, with pybind11 and the system's C++ compiler.
# The wheel's files are fetched and prepared in a staging folder, then moved into VENV's
# site-packages (megatron/ and its dist-info, whose RECORD names the helpers built here, so
# `pip show`/`pip uninstall megatron-core` work); a megatron-core already there is uninstalled
# first. triton, which its pipeline schedules import, comes from requirements/cpu.txt.
set -euo pipefail
venv=${1:?usage: install_mcore019.sh VENV}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py="$venv/bin/python"
tmp="$venv/.mcore019.partial"
rm -rf "$tmp" "$venv/.pybind11"
pip=("$py" -m pip install -q --no-deps --target)
"${pip[@]}" "$tmp" --python-version 3.12 --only-binary=:all: megatron-core==0.19.2
"${pip[@]}" "$venv/.pybind11" pybind11==3.1.0
patch -s -p1 -d "$tmp" < "$root/patches/megatron-core-0.19.2-py311.patch"
datasets="$tmp/megatron/core/datasets"
rm -f "$datasets"/helpers_cpp.cpython-3*.so
read -r includes suffix site < <("$py" -c "import sys, sysconfig; sys.path.insert(0, '$venv/.pybind11')
import pybind11
print('-I' + sysconfig.get_paths()['include'] + ',-I' + pybind11.get_include(),
      sysconfig.get_config_var('EXT_SUFFIX'), sysconfig.get_paths()['platlib'])")
${CXX:-g++} -O3 -shared -std=c++17 -fPIC ${includes//,/ } "$datasets/helpers.cpp" \
  -o "$datasets/helpers_cpp$suffix"
record="$tmp/megatron_core-0.19.2.dist-info/RECORD"
grep -v '^megatron/core/datasets/helpers_cpp\.cpython-3' "$record" > "$record.new"
echo "megatron/core/datasets/helpers_cpp$suffix,," >> "$record.new"
mv "$record.new" "$record"
rm -rf "$venv/.pybind11"
"$py" -m pip uninstall -q -y megatron-core 2>/dev/null || true
rm -rf "$site/megatron" "$site"/megatron_core-*.dist-info
mv "$tmp/megatron" "$tmp/megatron_core-0.19.2.dist-info" "$site/"
rm -rf "$tmp"
