"""A stand-in training script for the Slurm plumbing test: joins the gloo group the launcher's
rendezvous describes, all-reduces its rank, and prints what it was given.

Run as ``python gloo_probe.py <megatron args> --hetero-plan PLAN``; Megatron arguments other
than --hetero-plan are ignored.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

from megatron_hetero.plan import load_plan


def main(argv: list[str]) -> int:
    plan_path = argv[argv.index("--hetero-plan") + 1]
    plan = load_plan(plan_path)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    slot = plan.slot_of_rank(rank)
    print(f"probe rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']} "
          f"node={os.environ.get('SLURMD_NODENAME', socket.gethostname())} "
          f"device_type={os.environ.get('MEGATRON_HETERO_DEVICE_TYPE', '-')} "
          f"plan_device_type={plan.device_type_of_rank(rank)} "
          f"pipeline={slot.pipeline} stage={slot.stage} rank_sum={int(total.item())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
