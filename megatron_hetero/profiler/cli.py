"""``megatron-hetero profile``: the command's handler and its option parsing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ..errors import HeteroError
from ..outputs import Outputs
from ..plan import ModelSpec
from .device import pick_device
from .launch import run_profile
from .request import ProfileRequest


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HeteroError(f"{option}: {text!r}; expected comma-separated integers such as 1,2,4") \
            from None
    if not values or min(values) < 1:
        raise HeteroError(f"{option}: {text!r}; expected positive integers such as 1,2,4")
    return sorted(set(values))


def resolve_model(name: str, *, seq_length: int | None = None,
                  hidden_size: int | None = None) -> ModelSpec:
    """A model preset or a YAML file of ModelSpec fields (:func:`megatron_hetero.models.load_model`),
    optionally shrunk in width to ``hidden_size`` by the rehearsal's rule (so that a CPU profile
    and a CPU rehearsal of the same model have the same shape)."""
    from ..models import load_model, shrink_model

    model = load_model(name, seq_length=seq_length)
    if hidden_size is not None and hidden_size < model.hidden_size:
        model = shrink_model(model, hidden_size)
        if seq_length is not None:
            model = dataclasses.replace(model, seq_length=seq_length)
    return model


def shrink_note(full: ModelSpec, model: ModelSpec) -> str | None:
    """One line saying what ``profile --hidden-size`` changed besides the width (None when it
    changed nothing)."""
    keys = (("hidden_size", "hidden"), ("num_attention_heads", "heads"),
            ("num_query_groups", "query groups"), ("ffn_hidden_size", "FFN"),
            ("vocab_size", "vocabulary"), ("seq_length", "sequence"))
    changed = [f"{word} {getattr(full, k)} -> {getattr(model, k)}" for k, word in keys
               if getattr(full, k) != getattr(model, k)]
    if not changed:
        return None
    return (f"profile: {full.name} shrunk as the rehearsal shrinks it: {', '.join(changed)} "
            "(--seq-length and --vocab-size set the sequence and the vocabulary)")


def profile_main(args) -> int:
    """Handler of ``megatron-hetero profile``."""
    model = resolve_model(args.model, seq_length=args.seq_length, hidden_size=args.hidden_size)
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise HeteroError(f"--vocab-size {args.vocab_size}: expected a positive integer")
        model = dataclasses.replace(model, vocab_size=args.vocab_size)
    note = shrink_note(resolve_model(args.model, seq_length=args.seq_length), model)
    if note and args.hidden_size is not None:
        print(note, file=sys.stderr)
    inputs = {"--model": args.model} if Path(args.model).exists() else {}
    with Outputs("profile", inputs=inputs, outputs={"-o/--output": args.output}) as out:
        return _profile(args, model, out)


def _profile(args, model: ModelSpec, out: Outputs) -> int:
    pick_device(args.device)  # refuse --device cuda without CUDA before starting any rank
    request = ProfileRequest(
        model=model,
        micro_batch_sizes=_int_list(args.micro_batch_sizes, "--micro-batch-sizes"),
        tensor_parallel_sizes=_int_list(args.tensor_parallel_sizes, "--tensor-parallel-sizes"),
        warmup=args.warmup, repeats=args.repeats, device=args.device, precision=args.precision,
        device_type=args.device_type, cpu_threads=args.cpu_threads, layers=args.layers,
        bandwidth=not args.no_bandwidth, pipeline=not getattr(args, "no_pipeline", False),
        idle_factor=getattr(args, "idle_factor", 0.0), progress=not args.quiet,
    )
    data = run_profile(request, out.staged(args.output) if args.output else None)
    if data is None:  # a non-zero torchrun rank
        return 0
    eff = f"; layer efficiency {data.efficiency:.3f}" if data.efficiency else ""
    print(f"{args.output}: profile of {data.device.type} ({data.device.name}) for "
          f"{model.name} h={model.hidden_size} s={model.seq_length} v={model.vocab_size}: "
          f"{len(data.entries)} "
          f"entries{eff}")
    for e in data.entries:
        print(f"  TP={e.tensor_parallel_size} mbs={e.micro_batch_size}: layer fwd "
              f"{e.layer.forward_s * 1e3:.3f} ms bwd {e.layer.backward_s * 1e3:.3f} ms; "
              f"activations {e.memory.activation_bytes_per_layer / 2**20:.2f} MiB/layer"
              + (f"; after an idle gap of {data.timing.idle_factor:g}x a step costs "
                 f"{e.idle_penalty.forward_s * 1e3:+.3f} / {e.idle_penalty.backward_s * 1e3:+.3f} ms"
                 if e.idle_penalty else ""))
    if data.pipeline is not None:
        for e in data.pipeline.entries:
            print(f"  2-stage 1F1B pipeline, mbs={e.micro_batch_size}: per micro-batch and stage "
                  f"{e.forward_overhead_s * 1e3:+.3f} ms fwd, {e.backward_overhead_s * 1e3:+.3f} ms "
                  f"bwd beyond the parts")
    if data.device.backend == "cpu":
        import yaml

        from ..cost.profile_file import inventory_entry
        entry = yaml.safe_dump({data.device.type: inventory_entry(data)}, default_flow_style=True,
                               width=10_000).strip()
        print(f"to plan with this CPU, add under the inventory's `gpus:` key: {entry}")
    return 0
