"""Timing the embedding, the layer stack and the output part of a model; one layer's memory."""

from __future__ import annotations

import statistics
import time

from ..cost.profile_schema import MemoryFigures, PartTimes, ProfileEntry, StepPenalty
from .build import Parts
from .request import ProfileRequest, layer_flops


def measure_entry(parts: Parts, request: ProfileRequest, mbs: int, tp: int, timer, device,
                  advance) -> ProfileEntry:
    import torch

    m, gpt = request.model, parts.model
    s, h = m.seq_length, m.hidden_size
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(mbs)
    tokens = torch.randint(0, m.vocab_size, (mbs, s), generator=gen).to(dev)
    labels = torch.randint(0, m.vocab_size, (mbs, s), generator=gen).to(dev)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(mbs, s)
    hidden = torch.randn(s, mbs, h, generator=gen).to(dev, parts.dtype)
    layers = list(gpt.decoder.layers)

    def embedding_fwd():
        return gpt.embedding(input_ids=tokens, position_ids=positions)

    def layer_fwd():
        x = hidden.detach().requires_grad_()
        for layer in layers:
            out = layer(x, attention_mask=None, rotary_pos_emb=parts.rope)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def output_fwd():
        x = hidden.detach().requires_grad_()
        y = gpt.decoder.final_layernorm(x) if gpt.decoder.final_layernorm is not None else x
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else None
        logits, _ = gpt.output_layer(y, weight=weight)
        return gpt.compute_language_model_loss(labels, logits).sum()

    times = {}
    for name, fwd in (("embedding", embedding_fwd), ("layer", layer_fwd), ("output", output_fwd)):
        times[name] = _time_part(fwd, timer, request.warmup, request.repeats, parts.tp_group,
                                 per=len(layers) if name == "layer" else 1)
        advance(f"TP={tp} mbs={mbs} {name}")
    penalty = None
    if request.idle_factor > 0 and tp == 1 and device == "cpu":
        penalty = time_idle_penalty(layer_fwd, timer, request.warmup, request.repeats,
                                     request.idle_factor)
    memory = _measure_memory(layers, layer_fwd, device)
    flops = layer_flops(m, mbs, tp)
    layer_t = times["layer"]
    return ProfileEntry(micro_batch_size=mbs, tensor_parallel_size=tp, layer=layer_t,
                        embedding=times["embedding"], output=times["output"], memory=memory,
                        idle_penalty=penalty,
                        achieved_tflops=round(flops / (layer_t.forward_s + layer_t.backward_s) / 1e12, 6))


def _time_part(fwd, timer, warmup: int, repeats: int, tp_group, per: int = 1) -> PartTimes:
    """Median forward and backward seconds of ``fwd`` (divided by ``per``), slowest TP rank."""
    import torch
    import torch.distributed as dist

    fwd_s, bwd_s = [], []
    for i in range(warmup + repeats):
        tf, out = timer(fwd)
        grad = torch.ones_like(out)
        tb, _ = timer(lambda: torch.autograd.backward(out, grad))
        del out
        if i >= warmup:
            fwd_s.append(tf)
            bwd_s.append(tb)
    medians = torch.tensor([statistics.median(fwd_s) / per, statistics.median(bwd_s) / per],
                           dtype=torch.float64)
    if dist.get_world_size(tp_group) > 1:
        if torch.cuda.is_available() and dist.get_backend(tp_group) == "nccl":
            medians = medians.cuda()
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=tp_group)
    f, b = medians.tolist()
    return PartTimes(forward_s=sig(max(f, 1e-9)), backward_s=sig(max(b, 1e-9)))


def time_idle_penalty(fwd, timer, warmup: int, repeats: int, idle_factor: float) -> StepPenalty:
    """What one step (forward or backward of the layer stack, as one call) costs more when it
    follows an idle gap of ``idle_factor`` times its duration than when it follows other work.

    The rehearsal's speed emulation sleeps ``factor - 1`` times each step right after it, so
    every step of a rank starts after such a gap, in which other processes may use the core and
    its caches. Each round times, in this order: a forward after a sleep, its backward after a
    sleep, then a forward and its backward back to back (each right after the previous call's
    work); the medians' differences are returned, once per step (not per layer)."""
    import torch

    idle_f, idle_b, warm_f, warm_b = [], [], [], []
    for i in range(warmup + repeats):
        tf, out = timer(fwd)
        time.sleep(idle_factor * tf)
        tb, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        time.sleep(idle_factor * tb)
        tf2, out = timer(fwd)  # the forward above, slept after: this one is idle-timed
        time.sleep(idle_factor * tf2)
        tb2, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        tf3, out = timer(fwd)  # right after the backward's work: back to back
        tb3, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        time.sleep(idle_factor * tb3)
        if i >= warmup:
            idle_f.append(tf2)
            idle_b.append(tb2)
            warm_f.append(tf3)
            warm_b.append(tb3)
    return StepPenalty(
        forward_s=sig(statistics.median(idle_f) - statistics.median(warm_f)),
        backward_s=sig(statistics.median(idle_b) - statistics.median(warm_b)))


def sig(x: float) -> float:
    return float(f"{x:.6g}")


def _measure_memory(layers, layer_fwd, device: str) -> MemoryFigures:
    """Memory of one layer: the figures of ``layers`` run in sequence, divided by their count;
    ``peak_bytes`` is the peak of the whole stack's forward and backward."""
    import torch

    n = len(layers)
    params = [p for layer in layers for p in layer.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params) // n
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = layer_fwd()
        torch.cuda.synchronize()
        act = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return MemoryFigures(method="cuda-max-memory-allocated", parameter_bytes_per_layer=param_bytes,
                             activation_bytes_per_layer=max(act, 0) // n, peak_bytes=peak)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_storages and ptr not in saved:
            saved[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer_fwd()
    out.backward(torch.ones_like(out))
    act = sum(saved.values())
    return MemoryFigures(method="saved-tensors", parameter_bytes_per_layer=param_bytes,
                         activation_bytes_per_layer=act // n, peak_bytes=n * 2 * param_bytes + act)

