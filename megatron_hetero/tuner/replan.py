"""``megatron-hetero replan``: a plan for the pool that is left, under which the last checkpoint
loads.

From a checkpoint folder it reads the model, the sequence length and the global batch size
(Megatron's saved arguments, :mod:`megatron_hetero.launch.checkpoint`); from the old plan the same, when
only the plan is given. It tunes plan B on the new inventory with them, keeping the checkpoint's
precision and optimizer, and only tensor-parallel sizes under which the saved tensors keep their
shapes; it checks that the checkpoint loads under B, writes B (atomically, nothing written on a
refusal) and prints the restart command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..launch.checkpoint import FULLY_RESHARDABLE, Checkpoint, read_checkpoint
from ..errors import Described, HeteroError, InfeasibleError, SchemaError
from ..hardware.inventory import load_inventory
from ..plan.megatron_args import megatron_args_line
from ..models import load_model
from ..outputs import Outputs
from ..plan import ModelSpec, Plan, load_any_plan, save_plan
from ..placement.inventory import check_against_inventory
from .validation import validate_plan

__all__ = ["add_replan_arguments", "replan_main"]

_SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
          "num_query_groups", "seq_length", "swiglu", "normalization", "position_embedding_type",
          "untie_embeddings_and_output_weights", "add_bias_linear")
"""Model fields a checkpoint and a plan must agree on (the vocabulary is compared padded)."""


def add_replan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="CHECKPOINT_OR_PLAN",
                   help="the run's checkpoint folder (its --save), or its plan.yaml")
    p.add_argument("inventory", metavar="INVENTORY", help="inventory.yaml of the pool now")
    p.add_argument("-o", "--output", required=True, metavar="PLAN",
                   help="where to write the new plan (an existing file is replaced only on success)")
    p.add_argument("--plan", metavar="OLD",
                   help="the old plan, checked against the checkpoint (default: the --hetero-plan "
                        "the checkpoint's arguments name, where that file exists)")
    p.add_argument("--model", metavar="M", help="a preset or model YAML the checkpoint must hold")
    p.add_argument("--global-batch-size", type=int, metavar="N",
                   help="must equal the checkpoint's (Megatron resumes its sample count)")
    p.add_argument("--no-load-optim", action="store_true",
                   help="plan B restarts without the checkpoint's optimizer state (Megatron's "
                        "--no-load-optim: the weights load, Adam's state starts afresh); the "
                        "route for a checkpoint saved with Megatron's default 'dp_reshardable' "
                        "optimizer state, which loads only under its own TP and PP sizes; the "
                        "restart command carries the flag")
    from .commands import add_search_space_arguments

    add_search_space_arguments(p, tp_default="every size the checkpoint loads under that divides "
                                             "the heads and fits in a node")


def replan_main(args: argparse.Namespace) -> int:
    source = Path(args.source)
    inputs = {"INVENTORY": args.inventory, "--plan": args.plan, "CHECKPOINT_OR_PLAN": args.source}
    inputs.update({f"--profile {p}": p for p in args.profile or ()})
    with Outputs("replan", inputs=inputs, outputs={"-o/--output": args.output}) as out:
        return _replan(args, source, out)


def _replan(args: argparse.Namespace, source: Path, out: Outputs) -> int:
    from ..cost.profile_file import load_profiles
    from .commands import memory_headroom, parse_sizes
    from .problem import TuneOptions
    from .report import summary_lines
    from .search import tune

    inventory = load_inventory(args.inventory)
    ckpt, old, old_path = _sources(args, source)
    if old_path:  # the old plan, maybe found through the checkpoint's saved --hetero-plan
        out.add_input(f"the old plan (args.hetero_plan of {ckpt.common_file})" if ckpt
                      and not args.plan else "the old plan", old_path)
    model = _model(args, ckpt, old, old_path)
    gbs = ckpt.arg("global_batch_size") if ckpt else old.global_batch_size
    origin = f"{ckpt.common_file} args.global_batch_size" if ckpt else f"{old_path} global_batch_size"
    if args.global_batch_size is not None and args.global_batch_size != gbs:
        raise SchemaError("--global-batch-size", "", args.global_batch_size,
                          f"{gbs}, the checkpoint's ({origin}): Megatron resumes from its count "
                          "of consumed samples, so the global batch stays")
    if ckpt and old is not None and old.global_batch_size != gbs:
        raise SchemaError(old_path, "global_batch_size", old.global_batch_size,
                          f"{gbs}, the checkpoint's ({origin}); is it this run's plan?")
    tp_sizes = _loadable_tp_sizes(ckpt, old, model, args)
    options = TuneOptions(micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
                          tensor_parallel_sizes=tp_sizes,
                          precision=ckpt.precision if ckpt else old.precision,
                          use_distributed_optimizer=bool(ckpt.args.get("use_distributed_optimizer"))
                          if ckpt else old.use_distributed_optimizer,
                          memory_headroom=memory_headroom(args))
    profiles = load_profiles(args.profile, catalog=inventory.catalog) if args.profile else {}
    try:
        result = tune(model, inventory, gbs, profiles=profiles, options=options)
    except InfeasibleError as exc:
        raise InfeasibleError(f"{args.inventory}: cannot hold {model.name} ({model.num_layers} "
                              f"layers, hidden {model.hidden_size}) at global batch {gbs} in "
                              f"{options.precision}: {exc}") from None
    plan = result.plan
    if not result.sim.fits_memory:
        raise InfeasibleError(f"{args.inventory}: cannot hold {model.name} at global batch {gbs}"
                              f" in {options.precision}: the best plan needs more memory than "
                              "the pool has")
    check_against_inventory(plan, inventory, source=args.output)
    if ckpt:
        _check_loads(ckpt, plan, args.output, load_optim=not args.no_load_optim)
    save_plan(plan, out.staged(args.output))
    _as_validate_reads_it(out.staged(args.output), inventory, args.output,
                          options.memory_headroom)
    if ckpt:
        a = ckpt.args
        print(f"checkpoint {ckpt.folder}: iteration {ckpt.iteration}, {ckpt.format}, "
              f"{ckpt.size_bytes / 1e6:.1f} MB; saved under TP={a.get('tensor_model_parallel_size')}"
              f" PP={a.get('pipeline_model_parallel_size')} on {a.get('world_size')} ranks")
    if ckpt and old_path:
        print(f"old plan {old_path}: the same model and global batch as the checkpoint")
    print(f"model {model.name}: {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{model.num_attention_heads} heads, vocabulary {model.vocab_size}, sequence "
          f"{model.seq_length}; global batch {gbs}; {plan.precision}")
    print(summary_lines(plan, result.sim, "plan B  "))
    if ckpt:
        print(f"loads: {ckpt.format} reshards to TP={plan.tensor_model_parallel_size} "
              f"PP={plan.pipeline_model_parallel_size} DP={plan.data_parallel_size}; the "
              f"embedding keeps its {ckpt.padded_vocab_size(plan.tensor_model_parallel_size)} "
              f"rows; optimizer state "
              + ("not loaded (--no-load-optim: Adam's state starts afresh)" if args.no_load_optim
                 else f"{ckpt.optimizer_sharding or 'per parameter'}"))
    else:
        print(f"loads: not checked (give the checkpoint folder instead of {args.source} to check it)")
    load = str(ckpt.folder) if ckpt else "CHECKPOINT"
    restart = ["--load", load, "--ckpt-format", "torch_dist"]
    if args.no_load_optim:
        restart.append("--no-load-optim")
    print(f"wrote {args.output}")
    print(f"restart on {plan.world_size} GPUs, with the first run's data, tokenizer and schedule "
          "arguments added:")
    print("  scripts/slurm/submit.sh " + shlex.join([args.output, "--inventory", args.inventory,
                                                     "--", *restart]))
    print("  or per node: torchrun ... -m megatron_hetero.launch pretrain_gpt.py "
          f"{megatron_args_line(plan, args.output)} {shlex.join(restart)}")
    sys.stdout.flush()
    return 0


def _as_validate_reads_it(staged: Path, inventory, output: str, headroom: float) -> None:
    """Plan B as ``validate OUTPUT --inventory INVENTORY`` (with replan's memory headroom)
    would read and check it."""
    try:
        validate_plan(load_any_plan(staged, catalog=inventory.catalog), inventory, source=output,
                      memory_headroom=headroom)
    except HeteroError as exc:
        raise HeteroError(f"{str(exc).replace(str(staged), output)} (plan B was not written: "
                          "`validate` refuses it)") from None


def _sources(args, source: Path) -> tuple[Checkpoint | None, Plan | None, str | None]:
    """The checkpoint (None when SOURCE is a plan), the old plan (None when there is none) and
    its path."""
    if source.is_dir():
        ckpt = read_checkpoint(source)
        if ckpt.format == "torch":
            raise SchemaError(str(ckpt.iteration_folder), "", Described("a legacy 'torch' "
                              "checkpoint (one file per model-parallel rank)"),
                              "a torch_dist checkpoint, which Megatron reshards to other TP and "
                              "PP sizes and layer splits; the legacy format loads only under the "
                              "plan that saved it (convert it with Megatron's --ckpt-convert-format "
                              "torch_dist under that plan, then re-plan)")
        if ckpt.format != "torch_dist":
            raise SchemaError(str(ckpt.iteration_folder / "metadata.json"), "sharded_backend",
                              ckpt.format, "'torch_dist' (the format replan checks)")
        old_path = args.plan
        if old_path is None:
            named = ckpt.args.get("hetero_plan")
            old_path = named if isinstance(named, str) and Path(named).is_file() else None
        old = load_any_plan(old_path) if old_path else None
        return ckpt, old, old_path
    if not source.exists():
        raise SchemaError(str(source), "", Described("no such file or folder"),
                          "a checkpoint folder (the run's --save) or the run's plan.yaml")
    if args.plan:
        raise HeteroError(f"--plan {args.plan}: given with the plan {source}; expected --plan "
                          "only with a checkpoint folder")
    return None, load_any_plan(source), str(source)


def _model(args, ckpt: Checkpoint | None, old, old_path: str | None) -> ModelSpec:
    """The model to re-plan: the checkpoint's, checked against the old plan and ``--model``."""
    if ckpt is None:
        model = old.model
    else:
        name = old.model.name if old is not None else Path(ckpt.folder).name
        model = ckpt.model(name)
        _check_tensors(ckpt, model)
        if old is not None:
            tp = old.tensor_model_parallel_size if old.one_grid else None
            _same_model(old.model, ckpt, model, old_path, "model", tp)
    if args.model:
        given = load_model(args.model)
        if ckpt is not None:
            _same_model(given, ckpt, model, "--model", "", None)
        else:
            _same_model(given, None, model, "--model", "", None, where=old_path)
    return model


def _same_model(spec: ModelSpec, ckpt: Checkpoint | None, model: ModelSpec, source: str,
                prefix: str, tp: int | None, *, where: str | None = None) -> None:
    """Refuse ``spec`` (the old plan's or --model's) unless it is ``model`` (the checkpoint's)."""
    there = f"the checkpoint's ({ckpt.common_file} args)" if ckpt else f"the plan's ({where})"
    dot = f"{prefix}." if prefix else ""
    for key in _SHAPE:
        if getattr(spec, key) != getattr(model, key):
            raise SchemaError(source, f"{dot}{key}", getattr(spec, key),
                              f"{getattr(model, key)!r}, {there}: another model's checkpoint?")
    if ckpt is not None:
        t = tp or int(ckpt.args.get("tensor_model_parallel_size") or 1)
        unit = int(ckpt.args.get("make_vocab_size_divisible_by") or 128) * t
        if -(-spec.vocab_size // unit) * unit != ckpt.padded_vocab_size(t):
            raise SchemaError(source, f"{dot}vocab_size", spec.vocab_size,
                              f"{model.vocab_size} (padded to {ckpt.padded_vocab_size(t)}), {there}: "
                              "another model's checkpoint?")
    elif spec.vocab_size != model.vocab_size:
        raise SchemaError(source, f"{dot}vocab_size", spec.vocab_size,
                          f"{model.vocab_size}, {there}")


def _check_tensors(ckpt: Checkpoint, model: ModelSpec) -> None:
    """The saved tensors have the shapes the saved arguments describe."""
    index = str(ckpt.iteration_folder / ".metadata")
    tp = int(ckpt.args.get("tensor_model_parallel_size") or 1)
    emb = ckpt.tensors.get("embedding.word_embeddings.weight")
    want = (ckpt.padded_vocab_size(tp), model.hidden_size)
    if emb is not None and emb.shape != want:
        raise SchemaError(index, "embedding.word_embeddings.weight", Described(f"shape {emb.shape}"),
                          f"shape {want}, as {ckpt.common_file} args describe")
    for key, t in sorted(ckpt.tensors.items()):
        if key.startswith("decoder.layers.") and t.shape and t.shape[0] != model.num_layers:
            raise SchemaError(index, key, Described(f"{t.shape[0]} layers"),
                              f"{model.num_layers}, as {ckpt.common_file} args describe")


def _loadable_tp_sizes(ckpt: Checkpoint | None, old, model: ModelSpec, args) -> tuple[int, ...]:
    """Tensor-parallel sizes under which the saved tensors keep their global shapes: the
    embedding and output layer have ``vocab_size`` padded to a multiple of
    ``make_vocab_size_divisible_by`` x TP rows. Under a size that pads to more rows,
    megatron-core 0.17.1 loads the checkpoint without a word (a TP=1 save of 128 rows loaded
    under TP=2, 256 rows, on CPU ranks), but the rows it did not save start untrained, and the
    output layer's padding rows take part in the softmax: not the same training."""
    from .commands import parse_sizes

    asked = (parse_sizes(args.tensor_parallel_sizes, "--tensor-parallel-sizes")
             if args.tensor_parallel_sizes else tuple(range(1, model.num_attention_heads + 1)))
    heads = [t for t in asked if model.num_attention_heads % t == 0
             and model.num_query_groups % t == 0]
    if ckpt is not None:
        tp0 = int(ckpt.args.get("tensor_model_parallel_size") or 1)
        saved = ckpt.padded_vocab_size(tp0)
        fits = tuple(t for t in heads if ckpt.padded_vocab_size(t) == saved)
        why = f"the {saved} embedding rows saved in {ckpt.folder}"
        sharding = None if args.no_load_optim else ckpt.optimizer_sharding
        if sharding is not None and sharding not in FULLY_RESHARDABLE and tp0 in fits:
            fits = (tp0,)  # that optimizer state loads only under its TP (and PP) size
    elif old is not None and old.one_grid:
        from ..models import padded_vocab_size
        saved = padded_vocab_size(model, old.tensor_model_parallel_size)
        fits = tuple(t for t in heads if padded_vocab_size(model, t) == saved)
        why = f"the {saved} embedding rows of {args.source}'s TP={old.tensor_model_parallel_size}"
    else:
        fits = tuple(heads)
        why = "the heads"
    if not fits:
        raise SchemaError("--tensor-parallel-sizes", "", args.tensor_parallel_sizes or "default",
                          f"a size that divides the {model.num_attention_heads} heads and "
                          f"{model.num_query_groups} query groups and keeps {why} (vocabulary "
                          f"{model.vocab_size} padded to a multiple of 128 x TP)")
    return fits


def _check_loads(ckpt: Checkpoint, plan: Plan, source: str, *, load_optim: bool = True) -> None:
    """Refuse plan B where Megatron would refuse to load the checkpoint under it (its optimizer
    state too, unless ``load_optim`` is false: the restart passes ``--no-load-optim``)."""
    tp0 = int(ckpt.args.get("tensor_model_parallel_size") or 1)
    pp0 = int(ckpt.args.get("pipeline_model_parallel_size") or 1)
    tp, pp = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    rows = ckpt.padded_vocab_size(tp)
    if rows != ckpt.padded_vocab_size(tp0):
        raise SchemaError(source, "tensor_model_parallel_size", tp,
                          f"a size that keeps the {ckpt.padded_vocab_size(tp0)} embedding rows "
                          f"saved in {ckpt.folder} (TP={tp} pads to {rows})")
    sharding = ckpt.optimizer_sharding if load_optim else None
    if sharding is not None and sharding not in FULLY_RESHARDABLE and (tp, pp) != (tp0, pp0):
        raise SchemaError(f"{ckpt.common_file}", "content_metadata.distrib_optim_sharding_type",
                          sharding, f"a fully reshardable optimizer state to load under TP={tp} "
                          f"PP={pp} (saved under TP={tp0} PP={pp0}): Megatron loads "
                          f"'{sharding}' only under the same TP and PP sizes (Megatron's "
                          "default); save with --dist-ckpt-optim-fully-reshardable, or re-plan "
                          "with `replan --no-load-optim` (the weights load, Adam's state starts "
                          "afresh; the restart command carries the flag)")
