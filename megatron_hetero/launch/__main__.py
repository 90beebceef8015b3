"""Run an unchanged Megatron-LM training script with the megatron-hetero hooks installed.

    python -m megatron_hetero.launch [--cpu] /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron arguments> --hetero-plan plan.yaml

One process per rank, started by torchrun or srun as usual (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). ``--cpu`` (or ``MEGATRON_HETERO_CPU=1``) runs
megatron-core on the CPU backend over gloo, for rehearsals and CI. A mesh plan (``format_version:
2``) runs the same way on megatron-core 0.17 (docs/meshes.md, "Runtime"); on 0.16 every rank
refuses it before the model is built.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from ..errors import HeteroError
from ..mcore.cpu_backend import CPU_ENV, cpu_mode

__all__ = ["main"]

_USAGE = ("usage: python -m megatron_hetero.launch [--cpu] SCRIPT [MEGATRON ARGS ...] "
          "--hetero-plan PLAN")


def _cpu_requested(argv: list[str]) -> tuple[bool, list[str]]:
    if argv and argv[0] == "--cpu":
        return True, argv[1:]
    return cpu_mode(), argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu, argv = _cpu_requested(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE + "\n\n" + (__doc__ or ""), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = Path(argv[0])
    if not script.is_file():
        print(f"megatron-hetero launch: error: no such training script: {script}", file=sys.stderr)
        return 1
    # As `python SCRIPT` would: the script's directory first on the path (pretrain_gpt.py
    # imports its neighbours, and a Megatron-LM checkout's megatron.training lives there).
    sys.path.insert(0, str(script.resolve().parent))
    sys.argv = [str(script), *argv[1:]]
    try:
        if cpu:
            os.environ[CPU_ENV] = "1"
        from ..runtime.hooks import install
        from ..runtime.policies import set_launch_env

        set_launch_env(argv)  # NVTE_CPU_OFFLOAD_V1 before TE loads, for module-input offload
        install()  # prepares the CPU backend too when MEGATRON_HETERO_CPU=1
        runpy.run_path(str(script), run_name="__main__")
    except HeteroError as exc:
        print(f"megatron-hetero: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
