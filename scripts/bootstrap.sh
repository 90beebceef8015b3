#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU stack pinned for this
# machine's kind: Python 3.11, no GPU. Idempotent: reinstalls only when requirements change.
#
#   .venv/            torch==2.13.0 (CPU), megatron-core 0.19.2 (the default; its cp312 wheel made
#                     to run on 3.11 by scripts/install_mcore019.sh: the one patch, the dataset
#                     helpers built here), triton, the test tools, this package
#   .venv/mcore017/   megatron-core 0.17.1, the oldest supported release (it ships
#                     megatron.training), installed beside it with --no-deps: the tests' old end
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MEGATRON_HETERO_VENV:-$root/.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
stamp="$venv/.bootstrap-stamp"
want=$(cat "$root/requirements/cpu.txt" "$root/pyproject.toml" "$0" "$root/scripts/install_mcore019.sh" \
  "$root/patches/megatron-core-0.19.2-py311.patch" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: creating $venv (torch 2.13.0 CPU, megatron-core 0.19.2, 0.17.1 beside it; a few minutes)" >&2
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$root/requirements/cpu.txt"
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -m pip install -q --no-deps --ignore-requires-python \
  --target "$venv/mcore017" megatron-core==0.17.1
"$root/scripts/install_mcore019.sh" "$venv"
rm -rf "$venv/mcore019"  # where an earlier bootstrap put 0.19.2 beside 0.16.1
echo "$want" > "$stamp"
