#!/usr/bin/env bash
# Inventory -> plan + Megatron arguments in one step.
#
#   scripts/tune.sh INVENTORY OUTDIR --model M --global-batch-size N [other `tune` options]
#
# Writes into OUTDIR (created if missing):
#   plan.yaml           the tuned plan (megatron-hetero tune)
#   report.json         predicted step time, baseline, upper bound, per-stage figures
#   megatron_args.txt   the Megatron-LM arguments the plan implies, ending in --hetero-plan
# then checks the plan against the inventory and prints the launch commands.
# Environment: MH_PYTHON, a Python with megatron_hetero installed (default: the Python of the megatron-hetero on PATH, else python3).
set -euo pipefail

die() { echo "tune.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,11p' "${BASH_SOURCE[0]}"; }

case ${1:-} in -h|--help) usage; exit 0 ;; esac
[[ $# -ge 2 ]] || { usage >&2; die "expected INVENTORY OUTDIR --model M --global-batch-size N"; }
inventory=$1 outdir=$2
shift 2
[[ -f $inventory ]] || die "INVENTORY $inventory: no such file"
[[ " $* " == *" --model "* || " $* " == *" --model="* ]] || die "missing --model M (llama2-7b, llama2-13b, llama2-70b, ... or a model YAML)"
[[ " $* " == *" --global-batch-size "* || " $* " == *" --global-batch-size="* ]] || die "missing --global-batch-size N"
# The options this script sets itself: given again among tune's, tune would write elsewhere
# and the checks below would read a stale plan.
for arg in "$@"; do
    case $arg in
        -o|--output|--output=*|-o?*|--report|--report=*)
            die "$arg: tune.sh writes OUTDIR/plan.yaml and OUTDIR/report.json itself; expected no -o/--output or --report among tune's options (give OUTDIR instead)" ;;
    esac
done
PY=${MH_PYTHON:-}
if [[ -z $PY ]]; then  # the Python of the megatron-hetero on PATH, else python3
    mh=$(command -v megatron-hetero || true)
    if [[ -n $mh && -x $(dirname "$mh")/python ]]; then PY=$(dirname "$mh")/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "MH_PYTHON=$PY: not found"
"$PY" -c "import megatron_hetero" 2>/dev/null \
    || die "$PY cannot import megatron_hetero: set MH_PYTHON to the Python of the environment it is installed in (e.g. .venv/bin/python)"

mkdir -p "$outdir"
plan=$outdir/plan.yaml
"$PY" -m megatron_hetero.cli tune "$inventory" -o "$plan" --report "$outdir/report.json" "$@" \
    || die "megatron-hetero tune failed"
"$PY" -m megatron_hetero.cli validate "$plan" --inventory "$inventory" || die "the tuned plan does not fit $inventory"
"$PY" -m megatron_hetero.cli args "$plan" --inventory "$inventory" >"$outdir/megatron_args.txt" || die "megatron-hetero args failed"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cat <<EOF
tune.sh: wrote $plan, $outdir/report.json, $outdir/megatron_args.txt
Launch with Slurm (one heterogeneous job component per GPU type; name your partitions):
  MEGATRON_LM=/path/to/Megatron-LM $here/slurm/submit.sh $plan --inventory $inventory \\
      --partition TYPE=PARTITION ... -- <data, tokenizer and training arguments>
or with torchrun on every host of a host file ('HOST GPU_TYPE NUM_GPUS' lines):
  MEGATRON_LM=/path/to/Megatron-LM $here/launch_torchrun.sh HOSTFILE $plan -- <arguments>
EOF
