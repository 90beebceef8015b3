#!/usr/bin/env bash
# Submit a megatron-hetero plan to Slurm: one heterogeneous job component per GPU type.
#
#   MEGATRON_LM=$HOME/Megatron-LM scripts/slurm/submit.sh PLAN [options] [-- MEGATRON ARGS...]
#
# Options:
#   --inventory INV          GPUs per node and partition/constraint per type from INV's groups
#   --partition TYPE=NAME    partition of the nodes of GPU TYPE (repeatable; overrides INV)
#   --constraint TYPE=FEAT   node feature (--constraint) of GPU TYPE (repeatable; overrides INV)
#   --gpus-per-node N        GPUs per node of every type (overrides INV)
#   --no-gres                do not ask for --gpus-per-node (clusters without GPU GRES; CPU CI)
#   --sbatch ARG             an sbatch option for the whole job (--time=..., --account=...,
#                            --output=..., --wait); repeatable; given to every component
#   --dry-run                print the sbatch command instead of running it (or MH_DRY_RUN=1)
# MEGATRON ARGS are your own Megatron-LM arguments (data, tokenizer, iterations...).
#
# Environment: MEGATRON_LM (or MH_PRETRAIN_SCRIPT), MH_PYTHON (default: the Python of the megatron-hetero on PATH, else python3), MH_LAUNCH,
# MH_MASTER_PORT, MH_SRUN_ARGS, MH_ON_NODE_LOSS and its settings are passed on to the batch script
# (see megatron_hetero.sbatch; --inventory also sets MH_INVENTORY for the node-loss mode).
# MH_SET_DEVICE_TYPES=1 exports each component's GPU type to its tasks as
# MEGATRON_HETERO_DEVICE_TYPE (for GPUs the catalog does not name, and for CPU emulation).
set -euo pipefail

die() { echo "submit.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,21p' "${BASH_SOURCE[0]}"; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
batch=$here/megatron_hetero.sbatch
PY=${MH_PYTHON:-}
if [[ -z $PY ]]; then  # the Python of the megatron-hetero on PATH, else python3
    mh=$(command -v megatron-hetero || true)
    if [[ -n $mh && -x $(dirname "$mh")/python ]]; then PY=$(dirname "$mh")/python; else PY=python3; fi
fi

[[ $# -ge 1 ]] || { usage >&2; die "missing PLAN"; }
case $1 in -h|--help) usage; exit 0 ;; esac
plan=$1; shift
[[ -f $plan ]] || die "PLAN $plan: no such file"

spec=() sbatch_common=() dry=${MH_DRY_RUN:-0}
while [[ $# -gt 0 ]]; do
    case $1 in
        --inventory|--partition|--constraint|--gpus-per-node)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            spec+=("$1" "$2"); shift 2 ;;
        --inventory=*|--partition=*|--constraint=*|--gpus-per-node=*|--no-gres) spec+=("$1"); shift ;;
        --sbatch) [[ $# -ge 2 ]] || die "--sbatch needs a value"; sbatch_common+=("--common=$2"); shift 2 ;;
        --sbatch=*) sbatch_common+=("--common=${1#--sbatch=}"); shift ;;
        --dry-run) dry=1; shift ;;
        --) shift; break ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (Megatron arguments go after --)" ;;
    esac
done

if [[ -z ${MH_PRETRAIN_SCRIPT:-} ]]; then
    [[ -n ${MEGATRON_LM:-} ]] || die "MEGATRON_LM is not set: export MEGATRON_LM=/path/to/Megatron-LM (or MH_PRETRAIN_SCRIPT=/path/to/script.py)"
    [[ -f $MEGATRON_LM/pretrain_gpt.py ]] || die "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py"
fi
command -v "$PY" >/dev/null || die "MH_PYTHON=$PY: not found"
"$PY" -c "import megatron_hetero" 2>/dev/null \
    || die "$PY cannot import megatron_hetero: set MH_PYTHON to the Python of the environment it is installed in (e.g. .venv/bin/python)"

# Node-loss mode: a node that goes down must not take the job, and its batch script, with it
# (--no-kill; a heterogeneous job that loses a whole component still ends); where Slurm ends the
# job on a node failure all the same, it requeues it (--requeue) and it resumes from --load,
# appending to the same output file.
[[ ${MH_ON_NODE_LOSS:-} != replan ]] || sbatch_common+=(--common=--no-kill --common=--requeue --common=--open-mode=append)
# validate checks what the launch needs: against the inventory when one is given (the pool's
# GPUs, nodes and memory), as the runtime would.
validate_inv=()
for ((i = 0; i < ${#spec[@]}; i++)); do
    case ${spec[$i]} in
        --inventory) validate_inv=(--inventory "${spec[$((i + 1))]}") ;;
        --inventory=*) validate_inv=(--inventory "${spec[$i]#--inventory=}") ;;
    esac
done
if ! why=$("$PY" -m megatron_hetero.cli validate "$plan" "${validate_inv[@]}" 2>&1 >/dev/null); then
    die "the plan $plan does not validate${validate_inv:+ against ${validate_inv[1]}}: ${why#megatron-hetero validate: error: }"
fi
het_text=$("$PY" -m megatron_hetero.launch.jobspec "$plan" "${spec[@]}" "${sbatch_common[@]}" --print sbatch-args) \
    || die "cannot make Slurm components for $plan"
mapfile -t het_args <<<"$het_text"
MH_PLAN=$(realpath "$plan")
export MH_PLAN
# For the batch script's node-loss mode (MH_ON_NODE_LOSS=replan): the pool, and this command's
# selectors and sbatch options, one a line, for the resubmission under plan B.
pass_on=()
for ((i = 0; i < ${#spec[@]}; i++)); do
    case ${spec[$i]} in
        --inventory) i=$((i + 1)); MH_INVENTORY=$(realpath "${spec[$i]}"); export MH_INVENTORY ;;
        --inventory=*) MH_INVENTORY=$(realpath "${spec[$i]#--inventory=}"); export MH_INVENTORY ;;
        *) pass_on+=("${spec[$i]}") ;;
    esac
done
MH_SUBMIT_SPEC=$(printf '%s\n' "${pass_on[@]}")
MH_SUBMIT_COMMON=$(printf '%s\n' "${sbatch_common[@]}")
MH_BATCH_SCRIPT=$batch
export MH_SUBMIT_SPEC MH_SUBMIT_COMMON MH_BATCH_SCRIPT
if [[ ${MH_SET_DEVICE_TYPES:-0} == 1 ]]; then
    MH_DEVICE_TYPES=$("$PY" -m megatron_hetero.launch.jobspec "$plan" "${spec[@]}" --print device-types) \
        || die "cannot list the plan's device types"
    export MH_DEVICE_TYPES
fi

if ((dry)); then
    printf 'MH_PLAN=%q' "$MH_PLAN"
    [[ -z ${MH_DEVICE_TYPES:-} ]] || printf ' MH_DEVICE_TYPES=%q' "$MH_DEVICE_TYPES"
    printf ' sbatch'; printf ' %q' "${het_args[@]}" "$batch" "$@"; printf '\n'
    exit 0
fi
exec sbatch "${het_args[@]}" "$batch" "$@"
