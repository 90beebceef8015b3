"""Per-stage cost tables: for one stage position and every layer count, the time per
micro-batch and the cheapest memory policy that fits.

The policies, cheapest that fits wins: none; full recompute of the fewest layers (Megatron's
``block`` method); offloading part of the optimizer state to the host (in steps of 5 %, its
per-step cost spread over the average micro-batch count); all of it offloaded plus recompute;
where attention is unfused, selective recompute, alone or with offload; and (unless
``TuneOptions.activation_offload`` is off) offloading each layer's module inputs to the host
(fine-grained activation offload), alone, with the fewest layers of recompute, or with part
or all of the optimizer state offloaded. The baseline's
choices (full recompute only, or selective recompute alone) are kept beside them. Time and
memory are linear in the layer count, so each table is built from two evaluations.

With ``v`` > 1 model chunks per stage (interleaved 1F1B) the memory uses the exact in-flight
peak of the interleaved order (:func:`megatron_hetero.cost.schedule.peak_activations`): exact
at multiples of ``v`` layers (even chunks, :func:`even_chunks`) and linear between. A stage's
``block`` recompute covers its first layers in chunk order (the plan's semantics); the
baseline counts its recompute per chunk, as plain Megatron does (:func:`per_chunk_recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.schedule import peak_activations
from ..plan import Recompute
from .problem import Problem
from .space import Structure

__all__ = ["SELECTIVE", "StageTable", "StageTables", "even_chunks", "per_chunk_recompute",
           "recompute_code_key", "recompute_policy"]

SELECTIVE = -1
"""Recompute code of a stage that recomputes core attention only (Megatron's ``selective``);
codes >= 0 are layers of full recompute (``block``; all of them: ``uniform``)."""


def recompute_code_key(k: int) -> tuple:
    """The cost model's recompute key of recompute code ``k``."""
    if k == SELECTIVE:
        return ("selective", None, None)
    return ("none", None, None) if k == 0 else ("full", "block", k)


def recompute_policy(k: int, n: int) -> Recompute:
    """The plan's recompute of code ``k`` on a stage of ``n`` layers."""
    if k == SELECTIVE:
        return Recompute(granularity="selective")
    if k == 0:
        return Recompute()
    if k >= n:
        return Recompute(granularity="full", method="uniform", num_layers=1)
    return Recompute(granularity="full", method="block", num_layers=k)


def even_chunks(n: int, v: int, early: bool = False) -> tuple[int, ...]:
    """``n`` layers over ``v`` model chunks as evenly as possible, the later chunks taking the
    remainder (fewer of them are in flight: the least memory), or with ``early`` the earlier
    ones (the last stage's last chunk, which also runs the output layer, then holds fewer)."""
    q, r = divmod(n, v)
    return tuple(q + (c < r if early else c >= v - r) for c in range(v))


def per_chunk_recompute(k: int, n: int, v: int) -> int:
    """The baseline's recompute code ``k`` (layers of full recompute on a stage of ``n``)
    rounded up to the same count in each of ``v`` equal chunks: plain Megatron counts
    ``--recompute-num-layers`` per chunk. (The plan's ``block`` covers the stage's first ``k``
    layers in chunk order, which saves at least as much memory for the same work, so the
    baseline is not understated.)"""
    if v == 1 or k <= 0 or k > n:
        return k
    return min(-(-k // v) * v, n)


@dataclass(kw_only=True, slots=True)
class StageTable:
    """Per layer count ``n`` (index 0..L) of one stage position: time per micro-batch without
    recompute; the cheapest memory policy that fits (``k`` layers of full recompute or
    ``SELECTIVE``, ``f`` of the optimizer state offloaded; k > n: nothing fits) and its time
    per micro-batch, with the offload's per-step cost spread over the average micro-batch
    count; the cheapest recompute-only policy; the baseline's choices (full recompute of
    ``k_base`` layers; whether selective recompute alone fits, and its time); the per-step
    seconds of offloading all of the optimizer."""

    t_none: np.ndarray
    k: np.ndarray
    f: np.ndarray
    t_fit: np.ndarray
    k_rec: np.ndarray
    t_rec: np.ndarray
    k_base: np.ndarray
    t_base: np.ndarray
    sel_fits: np.ndarray
    t_sel: np.ndarray
    off_step: np.ndarray
    mi: np.ndarray
    """Whether the ``t_fit`` policy offloads module inputs (fine-grained activation offload)."""
    mi_rec: np.ndarray
    """The same for the ``t_rec`` policy (no optimizer offload)."""
    k_base_mi: np.ndarray
    """The baseline's other choice: module inputs offloaded everywhere plus full recompute of
    ``k_base_mi`` layers (big: nothing fits), at ``t_base_mi``."""
    t_base_mi: np.ndarray


class StageTables:
    """The stage tables of one search, each built once."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._tables: dict[tuple, StageTable] = {}

    def table(self, prec: str, gpu: str, tp: int, mbs: int, first: bool, last: bool,
              in_flight: float, D: int, vp: int = 1, pp: int = 1, stage: int = 0,
              m: int = 0) -> StageTable:
        """Costs of one stage position for every layer count (memory and time are linear in it).
        With ``vp`` > 1 chunks the stage is stage ``stage`` of ``pp`` running ``m`` micro-batches
        interleaved, ``in_flight`` its peak chunks in flight over ``vp`` (layers held per layer);
        memory is exact at multiples of ``vp`` layers (even chunks) and linear between."""
        key = (prec, gpu, tp, mbs, first, last, in_flight, D, vp, pp, stage, m)
        got = self._tables.get(key)
        if got is not None:
            return got
        cost, L = self.problem.cost(prec), self.problem.model.num_layers
        none = ("none", None, None)
        sp = tp > 1  # Megatron users run TP with --sequence-parallel; the plans say so
        n = np.arange(L + 1, dtype=float)

        def line(f, unit=1):
            a, b = f(unit), f(2 * unit)
            return a + (n - unit) * (b - a) / unit

        def memory(k, rk, mi=False):
            if vp == 1:
                return cost.memory_need(gpu, k, first, last, mbs, tp, rk, in_flight, D, 0.0, False,
                                        sp, mi)
            return cost.chunked_memory_need(gpu, even_chunks(k, vp), first, last, mbs, tp, rk, pp,
                                            stage, m, D, 0.0, False, sp, mi)

        t_none = line(lambda k: cost.compute_times(gpu, k, first, last, mbs, tp, none, False, sp).total_s)
        mems = {k: memory(k, none) for k in (vp, 2 * vp)}
        mem_none = line(lambda k: mems[k].total, vp)
        opt = line(lambda k: mems[k].optimizer, vp)
        off_step = line(lambda k: cost.optimizer_seconds(gpu, cost.stage_params(k, first, last, tp), D, 1.0)
                        - cost.optimizer_seconds(gpu, cost.stage_params(k, first, last, tp), D, 0.0))
        act = cost.layer_activation_bytes(gpu, mbs, tp, "none", sp)
        saving = in_flight * (act - cost.hidden_bytes(mbs, tp, sp))
        cap = cost.capacity(gpu)
        fwd_layer = cost.layer_times(gpu, mbs, tp)[0]
        m_avg = (self.problem.gbs // mbs) / D
        big = L + 1

        def layers_to_recompute(excess, saving):
            """Fewest layers of full recompute that remove ``excess`` bytes (big: impossible)."""
            k = np.where(excess <= 0, 0, np.ceil(np.maximum(excess, 0) / saving) if saving > 0 else big)
            return np.where((k > n) | (k < 0), big, k).astype(np.int64)

        def fraction(mem):
            """Least optimizer-state fraction (steps of 5 %) that makes ``mem`` fit (2: none)."""
            with np.errstate(divide="ignore", invalid="ignore"):
                frac = np.where(mem <= cap, 0.0, np.ceil((mem - cap) * (1 + 1e-9) / opt * 20) / 20)
            return np.where(np.isfinite(frac), frac, 2.0)

        def recompute_or_offload(mem, t, saving):
            """(codes, fractions, times) of three policies on top of a stage needing ``mem``
            bytes and ``t`` seconds: recompute only; part of the optimizer state offloaded;
            all of it offloaded and recompute what is still missing."""
            k_rec = np.where(mem <= cap, 0, layers_to_recompute(mem + act - cap, saving))
            frac = fraction(mem)
            k_all = np.where(mem - opt <= cap, 0, layers_to_recompute(mem - opt + act - cap, saving))
            return ([k_rec, np.zeros_like(k_rec), k_all],
                    [np.zeros_like(frac), np.minimum(frac, 1.0), np.ones_like(frac)],
                    [np.where(k_rec <= n, t + np.minimum(k_rec, n) * fwd_layer, np.inf),
                     np.where(frac <= 1.0, t + np.minimum(frac, 1.0) * off_step / m_avg, np.inf),
                     np.where(k_all <= n, t + np.minimum(k_all, n) * fwd_layer + off_step / m_avg,
                              np.inf)])

        # A: recompute only (also the baseline's choice); B: offload part of the optimizer
        # state, in steps of 5 %; C: offload all of it and recompute what is still missing
        ks, fs, ts = recompute_or_offload(mem_none, t_none, saving)
        k_a, t_a = ks[0], ts[0]
        # selective recompute drops the stored s x s attention matrices of an unfused kernel
        # for a recompute of core attention (with a fused kernel it saves nothing)
        sel = ("selective", None, None)
        t_sel = line(lambda k: cost.compute_times(gpu, k, first, last, mbs, tp, sel, False, sp).total_s)
        flash = cost.uses_flash_attention(gpu)
        mem_sel = mem_none if flash else line(lambda k: memory(k, sel).total, vp)
        sel_fits = mem_sel <= cap
        if not flash:
            # D: selective recompute; E: then offload part of the optimizer state
            frac_e = fraction(mem_sel)
            t_d = np.where(sel_fits, t_sel, np.inf)
            t_e = np.where(frac_e <= 1.0, t_sel + np.minimum(frac_e, 1.0) * off_step / m_avg, np.inf)
            sel_k = np.full_like(k_a, SELECTIVE)
            ks, fs, ts = ks + [sel_k, sel_k], fs + [np.zeros_like(frac_e), np.minimum(frac_e, 1.0)], \
                ts + [t_d, t_e]
        no = np.zeros(L + 1, dtype=bool)
        mis = [no] * len(ts)
        rec = [0, 3] if len(ts) > 3 else [0]  # no optimizer offload: A, D (and F below)
        k_f, t_f = np.full_like(k_a, big), np.full_like(t_a, np.inf)
        if self.problem.opt.activation_offload:
            # F, G, H: A, B and C with the module inputs offloaded (fine-grained activation
            # offload): less memory per layer, and recomputing a layer saves less
            mems_mi = {k: memory(k, none, True) for k in (vp, 2 * vp)}
            mem_mi = line(lambda k: mems_mi[k].total, vp)
            t_mi = line(lambda k: cost.compute_times(gpu, k, first, last, mbs, tp, none, False, sp,
                                                     True).total_s)
            kept = act - cost.module_input_bytes(mbs, tp, sp)
            saving_mi = in_flight * (kept - cost.hidden_bytes(mbs, tp, sp))
            ks_mi, fs_mi, ts_mi = recompute_or_offload(mem_mi, t_mi, saving_mi)
            k_f, t_f = ks_mi[0], ts_mi[0]
            rec.append(len(ts))
            ks, fs, ts = ks + ks_mi, fs + fs_mi, ts + ts_mi
            yes = np.ones(L + 1, dtype=bool)
            mis = mis + [yes, yes, yes]
        pick = np.argmin(np.stack(ts), axis=0)
        k = np.choose(pick, ks)
        f = np.choose(pick, fs)
        t_fit = np.choose(pick, ts)
        mi = np.choose(pick, mis)
        t_fit[0] = np.inf
        pick_r = np.argmin(np.stack([ts[i] for i in rec]), axis=0)
        k_rec = np.choose(pick_r, [ks[i] for i in rec])
        t_rec = np.choose(pick_r, [ts[i] for i in rec])
        mi_rec = np.choose(pick_r, [mis[i] for i in rec])
        t_rec[0] = np.inf
        t_base = t_a.copy()
        t_base[0] = np.inf
        t_f[0] = np.inf
        got = StageTable(t_none=t_none, k=k, f=f, t_fit=t_fit, k_rec=k_rec, t_rec=t_rec, k_base=k_a,
                         t_base=t_base, sel_fits=sel_fits, t_sel=t_sel, off_step=off_step,
                         mi=mi, mi_rec=mi_rec, k_base_mi=k_f, t_base_mi=t_f)
        self._tables[key] = got
        return got

    def for_structure(self, st: Structure, prec: str) -> list[list[StageTable]]:
        """The tables of every (template, stage) of a structure."""
        p, v, D = st.pp, st.vp, st.num_pipelines
        if v == 1:
            return [[self.table(prec, types[s], st.tp, st.mbs, s == 0, s == p - 1, p - s, D)
                     for s in range(p)] for types, _ in st.templates]
        # the peak is monotone in the micro-batches: count them as the average rounded up
        m = p * max(1, -(-(self.problem.gbs // st.mbs) // (D * p)))
        flight = [peak_activations(p, s, m, v, [1.0] * v) / v for s in range(p)]
        return [[self.table(prec, types[s], st.tp, st.mbs, s == 0, s == p - 1, flight[s], D,
                            v, p, s, m) for s in range(p)] for types, _ in st.templates]
