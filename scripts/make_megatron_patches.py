#!/usr/bin/env python3
"""Regenerate patches/<release line>/pretrain_gpt.patch from a Megatron-LM git clone.

    python scripts/make_megatron_patches.py /path/to/Megatron-LM.git

The patch adds two statements at the top of ``pretrain_gpt.py``'s ``__main__`` block, which
install megatron-hetero's hooks (``--hetero-plan``); nothing else of Megatron-LM changes.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

# release line -> the git ref whose pretrain_gpt.py the patch is made against
LINES = {"core_r0.16": "core_v0.16.1", "core_r0.17": "core_v0.17.1",
         "core_r0.18": "core_v0.18.2", "core_r0.19": "core_v0.19.0", "main": "main"}
ANCHOR = 'if __name__ == "__main__":'
ADDED = [
    "    # megatron-hetero: --hetero-plan PLAN applies a heterogeneous plan (placement, layer\n",
    "    # split, per-replica micro-batches, per-stage recompute and offload).\n",
    "    from megatron_hetero.runtime.hooks import install as install_megatron_hetero\n",
    "\n",
    "    install_megatron_hetero()\n",
    "\n",
]


def patched(lines: list[str]) -> list[str]:
    at = next(i for i, line in enumerate(lines) if line.rstrip() == ANCHOR)
    return lines[:at + 1] + ADDED + lines[at + 1:]


def main(repo: str) -> int:
    out_dir = Path(__file__).resolve().parents[1] / "patches"
    for line, ref in LINES.items():
        text = subprocess.run(["git", "--git-dir", repo, "show", f"{ref}:pretrain_gpt.py"],
                              check=True, capture_output=True, text=True).stdout
        old = text.splitlines(keepends=True)
        diff = difflib.unified_diff(old, patched(old), "a/pretrain_gpt.py", "b/pretrain_gpt.py")
        target = out_dir / line / "pretrain_gpt.patch"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(diff))
        print(f"{target.relative_to(out_dir.parent)}  (against {ref})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
