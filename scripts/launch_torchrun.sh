#!/usr/bin/env bash
# Launch a megatron-hetero plan with torchrun on hosts without Slurm. Run it on EVERY host
# (ssh, pdsh, a cluster manager...), with the same HOSTFILE and PLAN:
#
#   MEGATRON_LM=$HOME/Megatron-LM scripts/launch_torchrun.sh HOSTFILE PLAN [-- MEGATRON ARGS...]
#
# HOSTFILE names each host, its GPU type and (optionally) its GPU count, one host a line:
#
#   # host        gpu type           gpus
#   node-a100-0   A100-SXM-80GB      8
#   node-v100-0   V100-SXM2-32GB     8
#
# The hosts must offer at least the GPUs the plan needs (checked before anything starts). Of
# each GPU type the plan takes the first hosts in file order until it has its GPUs (the last
# one taken may give only some of its GPUs), and says on stderr which hosts or GPUs stay idle;
# on a host it does not take, the script exits 0 and runs nothing. The first host taken is the
# rendezvous master. torchrun starts one process per GPU taken on this host; the runtime then
# puts each rank on a plan slot of its GPU type.
#
# Environment:
#   MEGATRON_LM         Megatron-LM checkout (required unless MH_PRETRAIN_SCRIPT is set)
#   MH_PRETRAIN_SCRIPT  training script (default: $MEGATRON_LM/pretrain_gpt.py)
#   MH_LAUNCH           module (default: python -m megatron_hetero.launch SCRIPT) or patched
#                       (python SCRIPT: a Megatron-LM patched by `megatron-hetero patch-megatron`)
#   MH_PYTHON           Python with megatron_hetero and torch (default: the Python of the megatron-hetero on PATH, else python3)
#   MH_NODE_RANK        this host's place among the hosts taken, from 0 (default: found by
#                       hostname)
#   MH_MASTER_PORT      rendezvous port on the first host (default: 29500)
#   MH_GPUS_PER_NODE    GPU count of lines that give none
#   MH_SET_DEVICE_TYPES=1  export this host's GPU type as MEGATRON_HETERO_DEVICE_TYPE (for GPUs
#                       the catalog does not name, and for CPU emulation)
set -euo pipefail

die() { echo "launch_torchrun.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,26p' "${BASH_SOURCE[0]}"; }

case ${1:-} in -h|--help) usage; exit 0 ;; esac
[[ $# -ge 2 ]] || { usage >&2; die "expected HOSTFILE PLAN [-- MEGATRON ARGS...]"; }
hostfile=$1 plan=$2
shift 2
if [[ $# -gt 0 ]]; then
    [[ $1 == -- ]] || die "unexpected '$1': Megatron arguments go after --"
    shift
fi
[[ -f $hostfile ]] || die "HOSTFILE $hostfile: no such file"
[[ -f $plan ]] || die "PLAN $plan: no such file"
plan=$(realpath "$plan")

if [[ -z ${MH_PRETRAIN_SCRIPT:-} ]]; then
    [[ -n ${MEGATRON_LM:-} ]] || die "MEGATRON_LM is not set: export MEGATRON_LM=/path/to/Megatron-LM (or MH_PRETRAIN_SCRIPT=/path/to/script.py)"
    MH_PRETRAIN_SCRIPT=$MEGATRON_LM/pretrain_gpt.py
fi
[[ -f $MH_PRETRAIN_SCRIPT ]] || die "training script $MH_PRETRAIN_SCRIPT: no such file"
if [[ -n ${MEGATRON_LM:-} ]]; then
    export PYTHONPATH=$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}
fi
PY=${MH_PYTHON:-}
if [[ -z $PY ]]; then  # the Python of the megatron-hetero on PATH, else python3
    mh=$(command -v megatron-hetero || true)
    if [[ -n $mh && -x $(dirname "$mh")/python ]]; then PY=$(dirname "$mh")/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "MH_PYTHON=$PY: not found"
"$PY" -c "import megatron_hetero" 2>/dev/null \
    || die "$PY cannot import megatron_hetero: set MH_PYTHON to the Python of the environment it is installed in (e.g. .venv/bin/python)"

gpn_args=()
[[ -z ${MH_GPUS_PER_NODE:-} ]] || gpn_args=(--gpus-per-node "$MH_GPUS_PER_NODE")
# Canonical "host type gpus" lines, after checking that the hosts offer what the plan needs.
hosts_text=$("$PY" -m megatron_hetero.launch.jobspec "$plan" --hostfile "$hostfile" "${gpn_args[@]}" --print hosts) \
    || die "the hosts in $hostfile do not fit the plan $plan"
mapfile -t lines <<<"$hosts_text"
nnodes=${#lines[@]}

if [[ -n ${MH_NODE_RANK:-} ]]; then
    if ! [[ $MH_NODE_RANK =~ ^[0-9]+$ ]] || ((MH_NODE_RANK >= nnodes)); then
        die "MH_NODE_RANK=$MH_NODE_RANK: expected 0..$((nnodes - 1)) ($hostfile has $nnodes hosts)"
    fi
    node_rank=$MH_NODE_RANK
else
    names=" $(hostname) $(hostname -s) $(hostname -f 2>/dev/null || true) "
    node_rank="" matches=0
    for ((i = 0; i < nnodes; i++)); do
        read -r h _ _ <<<"${lines[$i]}"
        if [[ $names == *" $h "* ]]; then node_rank=${node_rank:-$i}; matches=$((matches + 1)); fi
    done
    if [[ -z $node_rank ]]; then
        # a host of the file the plan does not need: nothing runs here
        while read -r h _; do
            h=${h%%#*}
            if [[ -n $h && $names == *" $h "* ]]; then
                echo "launch_torchrun.sh: this host ($h) is in $hostfile but $plan does not need it: nothing to run here"
                exit 0
            fi
        done <"$hostfile"
        die "this host ($(hostname)) is not in $hostfile: add it, or set MH_NODE_RANK"
    fi
    ((matches == 1)) || die "this host ($(hostname)) is on $matches lines of $hostfile: set MH_NODE_RANK"
fi
read -r master _ _ <<<"${lines[0]}"
read -r _ device_type nproc <<<"${lines[$node_rank]}"
# Megatron-LM wants one CUDA work queue per device for its communication overlap (its own
# example scripts set this too).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
if [[ ${MH_SET_DEVICE_TYPES:-0} == 1 ]]; then
    export MEGATRON_HETERO_DEVICE_TYPE=$device_type
fi

plan_text=$("$PY" -m megatron_hetero.cli args "$plan" --one-per-line) || die "megatron-hetero args $plan failed"
mapfile -t plan_args <<<"$plan_text"
case ${MH_LAUNCH:-module} in
    module) target=(-m megatron_hetero.launch "$MH_PRETRAIN_SCRIPT") ;;
    patched) target=("$MH_PRETRAIN_SCRIPT") ;;
    *) die "MH_LAUNCH=$MH_LAUNCH: expected 'module' or 'patched'" ;;
esac

echo "launch_torchrun.sh: node $node_rank of $nnodes ($device_type x $nproc), master $master:${MH_MASTER_PORT:-29500}"
exec "$PY" -m torch.distributed.run --nnodes="$nnodes" --node-rank="$node_rank" \
    --nproc-per-node="$nproc" --master-addr="$master" --master-port="${MH_MASTER_PORT:-29500}" \
    "${target[@]}" "${plan_args[@]}" "$@"
