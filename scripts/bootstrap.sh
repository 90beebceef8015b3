#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU stack pinned for this
# machine's kind: Python 3.11, no GPU. Idempotent: reinstalls only when requirements change.
#
#   .venv/            torch==2.13.0 (CPU), megatron-core==0.16.1, the test tools, this package
#   .venv/mcore017/   megatron-core 0.17.1 (it ships megatron.training), installed beside it with
#                     --no-deps for the tests of Megatron-LM's own argument parsing
#   .venv/mcore019/   megatron-core 0.19.2 (cp312 wheel) made to run on 3.11, with triton
#                     (scripts/install_mcore019.sh: the one patch, the dataset helpers built here)
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
echo "bootstrap: creating $venv (torch 2.13.0 CPU, megatron-core 0.16.1, 0.17.1 and 0.19.2; a few minutes)" >&2
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$root/requirements/cpu.txt"
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" -m pip install -q --no-deps --ignore-requires-python \
  --target "$venv/mcore017" megatron-core==0.17.1
"$root/scripts/install_mcore019.sh" "$venv"
echo "$want" > "$stamp"
