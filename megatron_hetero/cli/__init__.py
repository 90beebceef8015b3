"""``megatron-hetero``: argument parsing only; the work happens in the modules named below.

Each subcommand names its handler as ``module:function``; the module is imported only when the
subcommand runs, so ``validate`` and ``tune`` never import torch.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import io
import os
import sys
from typing import Sequence

from .. import interrupts
from .._version import __version__
from ..errors import HeteroError

__all__ = ["main", "build_parser"]

_EPILOG = "Run `megatron-hetero COMMAND --help` for a command's options."


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check a plan (and that an inventory can host it)",
                       description="Check PLAN against the plan schema and its invariants and "
                                   "the offload settings megatron-core refuses, and that every "
                                   "stage fits its card's memory under the cost model, less the "
                                   "memory headroom (what the runtime would stop at; the cards "
                                   "are the catalog's, with the inventory's or the plan's own "
                                   "`gpus:` entries); with --inventory, also that the inventory "
                                   "has the GPUs it needs and that each node's host memory holds "
                                   "what its stages offload. Exits 0 when valid, 1 with the "
                                   "offending field path when not.")
    p.add_argument("plan", metavar="PLAN", help="plan.yaml")
    p.add_argument("--inventory", metavar="INV", help="inventory.yaml the plan must fit")
    p.add_argument("--no-memory-check", action="store_true",
                   help="do not refuse a stage that needs more memory than its card under the "
                        "cost model (or, with --inventory, a node more host memory)")
    from ..tuner.commands import add_memory_headroom_argument
    add_memory_headroom_argument(p)
    p.set_defaults(handler="megatron_hetero.cli.plan_commands:validate_main")


def _add_args(sub) -> None:
    p = sub.add_parser("args", help="print the Megatron-LM arguments a plan implies",
                       description="Print the Megatron-LM arguments PLAN implies, as one "
                                   "shell-ready line ending in --hetero-plan PLAN.")
    p.add_argument("plan", metavar="PLAN", help="plan.yaml")
    p.add_argument("--one-per-line", action="store_true", help="print one argument per line")
    p.add_argument("--inventory", metavar="INV",
                   help="inventory.yaml whose `gpus:` entries the plan's device types name")
    p.set_defaults(handler="megatron_hetero.cli.plan_commands:args_main")


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure per-layer costs of this device into profile.yaml",
                       description="Time real megatron-core layers (forward, backward), the "
                                   "embedding and the output layer with its loss on this device, "
                                   "per micro-batch size and tensor-parallel size; measure memory "
                                   "and, with more than one rank, p2p and all-reduce bandwidth. "
                                   "Feed the file to `tune --profile`. Format: "
                                   "docs/profile-format.md.")
    p.add_argument("--model", required=True, metavar="M",
                   help="model preset (e.g. llama2-7b) or a YAML file of model fields")
    p.add_argument("--seq-length", type=int, metavar="S", help="sequence length (default: the model's)")
    p.add_argument("--micro-batch-sizes", default="1", metavar="LIST", help="e.g. 1,2,4 (default 1)")
    p.add_argument("--tensor-parallel-sizes", default="1", metavar="LIST",
                   help="e.g. 1,2 (default 1); TP>1 starts that many processes")
    p.add_argument("--hidden-size", type=int, metavar="H",
                   help="shrink the model to this width (for a CPU run), as the rehearsal does: "
                        "heads, FFN, vocabulary and sequence keep their ratio to the width "
                        "(--seq-length and --vocab-size set the last two); it says what it "
                        "profiles")
    p.add_argument("--vocab-size", type=int, metavar="V", help="override the vocabulary size")
    p.add_argument("-o", "--output", default="profile.yaml", metavar="FILE",
                   help="where to write the profile (default profile.yaml)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="device to profile (default: cuda when available, else cpu)")
    p.add_argument("--device-type", metavar="NAME",
                   help="catalog name to record (default: detected; CPU on cpu)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="default: bf16 on GPU (fp16 without bf16), fp32 on CPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed iterations; median kept (default 5)")
    p.add_argument("--cpu-threads", type=int, default=1, metavar="N",
                   help="torch threads per CPU rank (default 1, as the rehearsal runs)")
    p.add_argument("--layers", type=int, default=2, metavar="N",
                   help="layers timed in sequence; figures are per layer (default 2)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the p2p/all-reduce figures")
    p.add_argument("--no-pipeline", action="store_true",
                   help="skip the 2-stage pipeline measurement (per-micro-batch overhead)")
    p.add_argument("--idle-factor", type=float, default=0.0, metavar="K",
                   help="CPU: also measure what a step costs more after an idle gap of K x its "
                        "duration, as the rehearsal runs a device K+1 times slower (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler="megatron_hetero.profiler:profile_main")


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="search the fastest plan for a model on an inventory",
                       description="Search parallel sizes, mixed pipelines, the uneven layer "
                                   "split, per-replica micro-batches and per-stage recompute for "
                                   "MODEL on INVENTORY; write the plan (with its prediction) and "
                                   "print it next to plain Megatron's best plan (the baseline).")
    from ..tuner.commands import add_tune_arguments
    add_tune_arguments(p)
    p.set_defaults(handler="megatron_hetero.tuner.commands:tune_main")


def _add_replan(sub) -> None:
    p = sub.add_parser("replan", help="re-plan a run from its checkpoint for the pool now",
                       description="Tune a new plan on INVENTORY for the model, sequence length "
                                   "and global batch size of a run's checkpoint (or old plan), "
                                   "check that the checkpoint loads under it (torch_dist, model "
                                   "shape, tensor-parallel sizes), write it and print the "
                                   "restart command. Refuses, writing nothing, a legacy torch "
                                   "checkpoint, another model's, an incomplete one, a pool that "
                                   "cannot hold the model and another global batch size.")
    from ..tuner.replan import add_replan_arguments
    add_replan_arguments(p)
    p.set_defaults(handler="megatron_hetero.tuner.replan:replan_main")


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="predict the step time of a plan, stage by stage",
                       description="Simulate one 1F1B training step of PLAN on INV under the cost "
                                   "model: step time, tokens/s, MFU, and busy/bubble/sync/idle "
                                   "time and memory per stage.")
    from ..tuner.commands import add_simulate_arguments
    add_simulate_arguments(p)
    p.set_defaults(handler="megatron_hetero.tuner.commands:simulate_main")


def _add_rehearse(sub) -> None:
    p = sub.add_parser("rehearse", help="run a plan on CPU processes that play its GPUs",
                       description="Rehearse PLAN on this machine: one CPU process per rank, each "
                                   "at its GPU type's relative speed and (scaled) memory, on the "
                                   "plan's model shrunk in width (same layers and split). Prints "
                                   "measured step time per pipeline and stage, bubbles, and the "
                                   "tuner's prediction for the same emulated cluster.")
    p.add_argument("plan", metavar="PLAN", help="plan.yaml")
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="training steps; the first is a warm-up (default 3)")
    p.add_argument("--hidden-size", type=int, default=64, metavar="H",
                   help="hidden size of the shrunk model (default 64)")
    p.add_argument("--verify", action="store_true",
                   help="also train in one process and check losses and final parameters match "
                        "(a bf16/fp16 plan: in its precision, against plain Megatron's)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="read the start-up calibration from FILE where it exists (measured for "
                        "the same shrunk model), else measure it and write it there")
    p.add_argument("--inventory", metavar="INV", help="inventory.yaml (for custom GPU entries)")
    p.add_argument("--time-scale", type=float, default=None, metavar="X",
                   help="slow every emulated device by X more (keeps cores free; default: the "
                        "least that keeps the ranks within 70%% of this machine's cores)")
    p.add_argument("--no-memory-cap", action="store_true", help="measure memory but do not cap it")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nice", type=int, default=0, metavar="N",
                   help="os.nice increment of the CPU ranks (negative, as root, shields the "
                        "emulated timing on a busy machine)")
    p.add_argument("--emulate-links", action="store_true",
                   help="make each pipeline message wait bytes / bandwidth + latency of the link "
                        "the inventory gives its two ranks, scaled like the compute (needs "
                        "--inventory)")
    p.add_argument("--link-latency", type=float, default=20e-6, metavar="S",
                   help="latency of one message on the real links with --emulate-links, in "
                        "seconds (default 2e-05)")
    p.add_argument("--slow", action="append", default=[], metavar="PATH=FACTOR[@STEP]",
                   help="make one stage of one replica FACTOR times slower from step STEP on "
                        "(counted from 1; default 1), e.g. 'pipelines[1].stages[0]=2.5@4'; "
                        "repeatable")
    p.add_argument("--telemetry", metavar="DIR",
                   help="write the runtime's telemetry (telemetry.jsonl, plan.yaml, "
                        "profile.<type>.yaml) from the CPU ranks to DIR")
    p.add_argument("--telemetry-interval", type=int, default=1, metavar="N",
                   help="report every N-th step after the warm-up (default 1)")
    p.add_argument("--rebalance", action="store_true",
                   help="move the replicas' micro-batch shares live when one drifts, as "
                        "--hetero-rebalance does in the runtime")
    p.add_argument("--rebalance-threshold", type=float, default=1.15, metavar="X",
                   help="a replica drifts beyond X times the replicas' median (default 1.15)")
    p.add_argument("--rebalance-patience", type=int, default=2, metavar="N",
                   help="reports in a row a replica must drift before shares move (default 2)")
    p.add_argument("--max-ranks", type=int, default=16, help=argparse.SUPPRESS)
    p.set_defaults(handler="megatron_hetero.cli.rehearse:rehearse_main")


def _add_patch_megatron(sub) -> None:
    p = sub.add_parser("patch-megatron", help="add --hetero-plan to a Megatron-LM checkout",
                       description="Apply the patch of PATH's Megatron-LM release line "
                                   "(patches/<line>/pretrain_gpt.patch), which makes "
                                   "pretrain_gpt.py accept --hetero-plan PLAN. With --check, only "
                                   "check that it applies.")
    p.add_argument("path", metavar="PATH", help="root of the Megatron-LM checkout")
    p.add_argument("--check", action="store_true", help="check only; change nothing")
    p.set_defaults(handler="megatron_hetero.runtime.patching:patch_megatron_main")


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="what a run's telemetry measured against its plan",
                       description="Read DIR/telemetry.jsonl, written by a run with "
                                   "--hetero-telemetry DIR: per stage of each replica, the "
                                   "measured seconds of a step beside the plan's prediction "
                                   "(median over the reported steps), and the slow stages named "
                                   "by plan path.")
    p.add_argument("dir", metavar="DIR", help="the run's --hetero-telemetry folder")
    p.add_argument("--step", type=int, metavar="N", help="one reported step instead of the median")
    p.add_argument("--threshold", type=_ratio, default=1.15, metavar="X",
                   help="a stage is slow when its measured/predicted compute exceeds the job's "
                        "median ratio by more than X times (default 1.15)")
    p.add_argument("--timeline", metavar="PNG",
                   help="draw the last reported step's measured timeline above the predicted one")
    p.add_argument("--inventory", metavar="INV",
                   help="inventory.yaml for the predicted timeline (default: the catalog's links)")
    p.add_argument("--json", metavar="FILE", help="write each stage's ratio and the slow stages")
    p.set_defaults(handler="megatron_hetero.cli.report:report_main")


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 100.0:
        raise argparse.ArgumentTypeError(f"found {text!r}; expected a ratio from 1 to 100")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-hetero",
        description="Plan and run Megatron-LM training on a mixed pool of GPUs.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


_COMMANDS = [_add_validate, _add_args, _add_profile, _add_tune, _add_replan, _add_simulate,
             _add_rehearse, _add_report, _add_patch_megatron]


class _ReaderMayLeave:
    """``sys.stdout`` for one command: a reader that went away (``megatron-hetero ... | head
    -1``) ends what is shown, not the command. The first write or flush that meets the closed
    pipe points the descriptor at ``/dev/null`` (so that the interpreter's last flush finds
    nothing to complain about) and drops the rest; the command goes on, writes its files and
    exits as it would have."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self._gone = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # not a descriptor (a test's capture): nothing is flushed at exit

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user's mistake is one line and exit 1; Ctrl-C at any moment (start-up
    included: :mod:`megatron_hetero.interrupts`) one line and exit 130; files a command writes
    are put in place only once it has succeeded (:mod:`megatron_hetero.outputs`)."""
    command = "megatron-hetero"
    stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(stdout)
    try:
        interrupts.deliver()
        args = build_parser().parse_args(argv)
        command = f"megatron-hetero {args.command}"
        module, func = args.handler.split(":")
        handler = getattr(importlib.import_module(module), func)
        code = int(handler(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is met quietly
        if interrupts.pending():  # raised where the interpreter swallowed it
            raise KeyboardInterrupt
        return code
    except HeteroError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            print(f"{command}: error: {exc.strerror}; every existing file is as it was (the "
                  "outputs are put in place only once the command has succeeded)", file=sys.stderr)
            return 1
        if exc.filename is None:  # not about a path the user gave: a bug, keep the traceback
            raise
        print(f"{command}: error: {exc.filename}: {exc.strerror}; expected "
              "a path this command can read or write", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupts.ignore()
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout
        interrupts.restore()

