"""Model presets (and their width-shrunk copies for CPU runs) and the per-layer costs of a
Llama-style decoder: FLOPs, parameter and activation bytes.

Every figure is for one micro-batch of ``b`` sequences of ``s`` tokens, for the whole layer
(divide by the tensor-parallel size where the text says so). Notation: ``h`` hidden size, ``f``
FFN hidden size, ``a`` attention heads, ``g`` query groups, ``d`` the head size
(``kv_channels``, by default ``h / a``), ``h_q = a * d`` the query width (``h`` by default),
``h_kv = g * d`` the key/value width, ``V`` the padded vocabulary, ``t`` the tensor-parallel
size.

FLOPs (multiply-add = 2 FLOPs), forward of one layer::

    QKV 2bsh(h_q + 2h_kv) + scores 2bs^2h_q + context 2bs^2h_q + projection 2bs h_q h
    + MLP 2bshf * (3 with SwiGLU, 2 without)

Parameters: the QKV, projection and MLP weights, two norms, the biases where
``add_bias_linear`` (every linear layer) or ``add_qkv_bias`` (QKV only) asks, and with
``qk_layernorm`` a norm of ``d`` channels over each query and each key head.

Backward is twice the forward. Attention is counted without the causal half (Megatron's and
PaLM's MFU convention). The output layer costs 2bshV forward and 4bshV backward; the embedding
lookup costs nothing.

Activation bytes saved per layer for backward (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4, no sequence parallelism), adapted to GQA and
SwiGLU term by term; 16-bit activations, 1-byte dropout masks::

    replicated on every tensor rank: 2 LayerNorm inputs 4sbh, QKV input 2sbh, MLP input 2sbh,
                                     two dropout masks 2sbh                     -> 10sbh
    sharded over t: Q 2sb*h_q, K and V 4sb*h_kv, projection input 2sb*h_q,
                    MLP: SwiGLU input 4sbf + fc2 input 2sbf (GeLU: 2sbf + 2sbf)
    core attention (sharded): softmax 2as^2b + dropout mask as^2b + dropout out 2as^2b = 5as^2b

Mixture of experts (``num_experts`` E set; ``k`` the router's top-k, ``f_e`` one expert's FFN
size, ``f_s`` the shared experts' together, ``M`` the MoE layers among the ``L``). An MoE layer
replaces the MLP by::

    FLOPs   router 2bshE + routed experts 2bs k h f_e (3|2) + shared experts 2bshf_s (3|2)
    params  router hE + E experts h f_e (3|2) + shared h f_s (3|2) (+ h with the shared gate)
    bytes   router scores (fp32) 4sbE + dispatched tokens 2sbkh + experts' SwiGLU input 4sbkf_e
            and fc2 input 2sbkf_e (GeLU: 2 + 2) + shared experts as a dense MLP of f_s

(attention, norms and their activations as a dense layer). The expert terms are sharded over
``t`` like the MLP's: megatron-core's MoE layer with TP runs sequence parallelism, each rank
routing ``1/t`` of the tokens (expert tensor parallelism splits the same work another way).
Expert parallelism shards the experts' weights, not their work: each rank of an EP group
receives on average the ``k`` routed copies of as many tokens as it sent. The per-layer figures
of an MoE model (:func:`layer_forward_flops`, :func:`layer_activation_bytes`, the parts of
:func:`layer_param_parts`) are the mean over its layers: a stage of ``n`` layers holds ``n M / L``
MoE layers in the cost model (exact where every layer is one, as in the presets).
:func:`model_layer_params` counts the layers exactly.

For plain multi-head attention with ``f = 4h`` and no SwiGLU this is Korthikanti's
``sbh(10 + 24/t + 5as/(ht))``. Selective recompute drops the core-attention term; full recompute
keeps only the layer input (2sbh). With a fused (flash) attention kernel the core-attention term
is never stored, so ``none`` costs what ``selective`` does (see :class:`ActivationPolicy`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Literal

from ._schema import from_data, read_yaml
from .errors import HeteroError, SchemaError
from .limits import check_model_size
from .plan import ModelSpec

__all__ = ["PRESETS", "model_preset", "load_model", "shrink_model", "padded_vocab_size",
           "layer_forward_flops", "output_forward_flops", "layer_params", "embedding_params",
           "output_params", "layer_activation_bytes", "core_attention_forward_flops",
           "step_model_flops", "layer_input_bytes", "logits_bytes", "moe_fraction",
           "layer_param_parts", "model_layer_params", "expert_forward_flops",
           "moe_dispatch_bytes", "mixed_model", "column_linear_forward_flops"]

PRESETS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec(name="llama2-7b", num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                           num_attention_heads=32, num_query_groups=32, vocab_size=32000,
                           seq_length=4096),
    "llama2-13b": ModelSpec(name="llama2-13b", num_layers=40, hidden_size=5120,
                            ffn_hidden_size=13824, num_attention_heads=40, num_query_groups=40,
                            vocab_size=32000, seq_length=4096),
    "llama2-70b": ModelSpec(name="llama2-70b", num_layers=80, hidden_size=8192,
                            ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
                            vocab_size=32000, seq_length=4096),
    "llama3-8b": ModelSpec(name="llama3-8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                           num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                           seq_length=8192),
    "llama3-70b": ModelSpec(name="llama3-70b", num_layers=80, hidden_size=8192,
                            ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
                            vocab_size=128256, seq_length=8192),
    # mixtures of experts (their published config.json, in Megatron's names)
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096,
                              ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                              vocab_size=32000, seq_length=4096, rotary_base=1000000,
                              num_experts=8, moe_router_topk=2),
    "qwen3-30b-a3b": ModelSpec(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048,
                               ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
                               kv_channels=128, vocab_size=151936, seq_length=4096,
                               qk_layernorm=True, rotary_base=1000000, num_experts=128,
                               moe_router_topk=8, moe_ffn_hidden_size=768),
    "qwen2-57b-a14b": ModelSpec(name="qwen2-57b-a14b", num_layers=28, hidden_size=3584,
                                ffn_hidden_size=18944, num_attention_heads=28,
                                num_query_groups=4, vocab_size=151936, seq_length=4096,
                                add_qkv_bias=True, rotary_base=1000000, num_experts=64,
                                moe_router_topk=8, moe_ffn_hidden_size=2560,
                                moe_shared_expert_intermediate_size=20480,
                                moe_shared_expert_gate=True),
}
"""Presets by name (Megatron argument names; sequence length as published, 4096 for the
mixtures of experts): Llama 2 and 3, and the mixtures of experts Mixtral 8x7B (8 experts, top
2), Qwen3-30B-A3B (128 experts of 768, top 8) and Qwen2-57B-A14B (64 experts of 2560, top 8, a
gated shared expert of 20480)."""

Policy = Literal["none", "selective", "full"]


def model_preset(name: str, *, seq_length: int | None = None) -> ModelSpec:
    """A copy of preset ``name``, with ``seq_length`` replaced when given."""
    if name not in PRESETS:
        raise SchemaError("--model", "", name, "a preset (" + ", ".join(PRESETS)
                          + ") or a YAML file with the model fields")
    spec = PRESETS[name]
    if seq_length is None:
        return dataclasses.replace(spec)
    return dataclasses.replace(spec, seq_length=_checked_seq_length(seq_length))


def _checked_seq_length(seq_length: int) -> int:
    """``--seq-length``, named as the flag (not as a field of the model file it replaces)."""
    return check_model_size("seq_length", seq_length, source="--seq-length", path="")


def load_model(name_or_path: str, *, seq_length: int | None = None) -> ModelSpec:
    """A preset name, or a YAML file holding the :class:`ModelSpec` fields."""
    if name_or_path in PRESETS:
        return model_preset(name_or_path, seq_length=seq_length)
    path = Path(name_or_path)
    if not path.is_file():
        model_preset(name_or_path)  # raises the message listing the presets
    data = read_yaml(path)
    if isinstance(data, dict) and seq_length is not None:
        data = {**data, "seq_length": _checked_seq_length(seq_length)}
    return from_data(ModelSpec, data, source=str(path))


def _round_to(x: float, unit: int) -> int:
    return max(unit, int(round(x / unit)) * unit)


def shrink_model(m: ModelSpec, hidden_size: int, tp: int = 1) -> ModelSpec:
    """``m`` shrunk in width to ``hidden_size`` (the CPU rehearsal's and the CPU profile's
    model): heads keep a head size of at least 8 and the model's query-group ratio where they
    can; FFN (the experts' too), vocabulary and sequence keep their ratio to the hidden size.
    Layer count, experts and everything else stay. A model no wider than ``hidden_size`` is returned unchanged."""
    if hidden_size >= m.hidden_size:
        return m
    h = hidden_size
    r = h / m.hidden_size
    gqa = m.num_attention_heads // m.num_query_groups
    heads = groups = None
    for n in range(min(m.num_attention_heads, max(h // 8, 1)), 0, -1):
        if h % n or n % tp or (h // n) % 2:  # rope needs an even size per head
            continue
        g = n // gqa if n % gqa == 0 and (n // gqa) % tp == 0 else n
        heads, groups = n, g
        break
    if heads is None:
        raise HeteroError(f"--hidden-size {h}: no head count divides it into even head sizes "
                          f"and is divisible by the tensor-parallel size {tp}; use a multiple of "
                          f"{8 * tp}")
    return dataclasses.replace(  # heads h / heads wide: a kv_channels of the model is dropped
        m, name=f"{m.name}-shrunk-h{h}", hidden_size=h, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=None,
        ffn_hidden_size=_round_to(m.ffn_hidden_size * r, 8 * tp),
        moe_ffn_hidden_size=(None if m.moe_ffn_hidden_size is None
                             else _round_to(m.moe_ffn_hidden_size * r, 8 * tp)),
        moe_shared_expert_intermediate_size=(
            None if m.moe_shared_expert_intermediate_size is None
            else _round_to(m.moe_shared_expert_intermediate_size * r, 8 * tp)),
        vocab_size=_round_to(m.vocab_size * r, 16 * tp),
        seq_length=min(m.seq_length, max(16, _round_to(m.seq_length * r, 8))))


def padded_vocab_size(m: ModelSpec, tp: int = 1) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by)."""
    unit = 128 * tp
    return -(-m.vocab_size // unit) * unit


def _kv(m: ModelSpec) -> int:
    """``h_kv``: the key (or value) width."""
    return m.num_query_groups * m.head_size


def _q(m: ModelSpec) -> int:
    """``h_q``: the query width (the hidden size unless ``kv_channels`` says otherwise)."""
    return m.num_attention_heads * m.head_size


def core_attention_forward_flops(m: ModelSpec, b: int) -> float:
    """Scores and context matmuls of one layer's forward (what selective recompute redoes)."""
    return 4.0 * b * m.seq_length ** 2 * _q(m)


def layer_forward_flops(m: ModelSpec, b: int) -> float:
    """Forward FLOPs of one transformer layer for a micro-batch of ``b`` sequences (an MoE
    model's: the mean over its layers, routed experts included)."""
    s, h, f, q = m.seq_length, m.hidden_size, m.ffn_hidden_size, _q(m)
    linear = 2.0 * b * s * h * (q + 2 * _kv(m)) + 2.0 * b * s * q * h
    mlp = 2.0 * b * s * h * f * (3 if m.swiglu else 2)
    if m.is_moe:
        x = moe_fraction(m)
        moe = 2.0 * b * s * h * m.num_experts + _shared_flops(m, b) + expert_forward_flops(m, b) / x
        mlp = (1.0 - x) * mlp + x * moe
    return linear + mlp + core_attention_forward_flops(m, b)


def column_linear_forward_flops(m: ModelSpec, b: int) -> tuple[float, float]:
    """Forward FLOPs of a layer's two column-parallel linears, QKV and the dense MLP's fc1
    (its backward's input-gradient and weight-gradient GEMMs each take as many): the GEMMs
    behind which megatron-core's backward hides their input gradient's tensor-parallel
    all-reduce (or reduce-scatter)."""
    s, h, f, q = m.seq_length, m.hidden_size, m.ffn_hidden_size, _q(m)
    return 2.0 * b * s * h * (q + 2 * _kv(m)), 2.0 * b * s * h * f * (2 if m.swiglu else 1)


def moe_fraction(m: ModelSpec) -> float:
    """``M / L``: the share of the layers that are MoE layers (0 for a dense model)."""
    return sum(m.moe_layer_pattern) / m.num_layers


def _mlp_width(m: ModelSpec) -> int:
    return 3 if m.swiglu else 2


def _shared_flops(m: ModelSpec, b: int) -> float:
    fs = m.moe_shared_expert_intermediate_size or 0
    return 2.0 * b * m.seq_length * m.hidden_size * fs * _mlp_width(m)


def expert_forward_flops(m: ModelSpec, b: int) -> float:
    """Forward FLOPs of the routed experts per layer (mean over the layers): ``k`` copies of
    every token through one expert's MLP (what a load imbalance slows down)."""
    if not m.is_moe:
        return 0.0
    per_moe = (2.0 * b * m.seq_length * m.moe_router_topk * m.hidden_size
               * m.expert_ffn_hidden_size * _mlp_width(m))
    return moe_fraction(m) * per_moe


def mixed_model(m: ModelSpec, moe_layers: int, layers: int) -> ModelSpec:
    """``m`` as a model whose per-layer means are those of ``layers`` layers of which
    ``moe_layers`` are MoE layers (a stage of a model that mixes them): its dense layer where
    none is, else ``m`` with that share of MoE layers (the per-layer figures read nothing else
    of the layer count)."""
    if moe_layers == 0:
        return dataclasses.replace(m, num_experts=None, moe_router_topk=2,
                                   moe_ffn_hidden_size=None,
                                   moe_shared_expert_intermediate_size=None,
                                   moe_shared_expert_gate=False, moe_layer_freq=1,
                                   moe_router_load_balancing_type="aux_loss",
                                   moe_grouped_gemm=False)
    g = math.gcd(moe_layers, layers)
    k, n = moe_layers // g, layers // g
    return dataclasses.replace(m, num_layers=n, moe_layer_freq=1 if k == n else [1] * k + [0] * (n - k))


def moe_dispatch_bytes(m: ModelSpec, b: int) -> float:
    """Bytes of one dispatch (or combine) all-to-all per layer (mean over the layers), before
    tensor parallelism splits the tokens: the ``k`` routed 16-bit copies of every token."""
    if not m.is_moe:
        return 0.0
    return moe_fraction(m) * 2.0 * b * m.seq_length * m.moe_router_topk * m.hidden_size


def output_forward_flops(m: ModelSpec, b: int, tp: int = 1) -> float:
    """Forward FLOPs of the output layer (logits) over the padded vocabulary."""
    return 2.0 * b * m.seq_length * m.hidden_size * padded_vocab_size(m, tp)


def step_model_flops(m: ModelSpec, global_batch_size: int) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute, unpadded vocab)."""
    per_seq = m.num_layers * layer_forward_flops(m, 1) + 2.0 * m.seq_length * m.hidden_size * m.vocab_size
    return 3.0 * per_seq * global_batch_size


def layer_params(m: ModelSpec) -> int:
    """Parameters of one dense transformer layer (weights, norms and biases); an MoE model's
    layers: :func:`layer_param_parts`, :func:`model_layer_params`."""
    h, f, kv, q = m.hidden_size, m.ffn_hidden_size, _kv(m), _q(m)
    per_norm = 1 if m.normalization == "RMSNorm" else 2  # weight (and bias)
    n = h * (q + 2 * kv) + q * h + h * f * (3 if m.swiglu else 2)
    n += 2 * per_norm * h
    if m.add_bias_linear:
        n += (q + 2 * kv) + h + (2 * f if m.swiglu else f) + h
    elif m.add_qkv_bias:
        n += q + 2 * kv
    if m.qk_layernorm:
        n += 2 * per_norm * m.head_size
    return n


def _mlp_params(m: ModelSpec, f: int) -> int:
    """One MLP of hidden size ``f`` (weights, and biases where ``add_bias_linear``)."""
    n = m.hidden_size * f * _mlp_width(m)
    if m.add_bias_linear:
        n += (2 * f if m.swiglu else f) + m.hidden_size
    return n


def _moe_params(m: ModelSpec) -> tuple[int, int]:
    """(router and shared experts, routed experts) of one MoE layer."""
    h, fs = m.hidden_size, m.moe_shared_expert_intermediate_size
    replicated = h * m.num_experts
    if fs:
        replicated += _mlp_params(m, fs) + (h if m.moe_shared_expert_gate else 0)
    return replicated, m.num_experts * _mlp_params(m, m.expert_ffn_hidden_size)


def layer_param_parts(m: ModelSpec) -> tuple[float, float]:
    """(parameters every rank of a layer's tensor group holds a share of, routed-expert
    parameters that expert parallelism shards), the mean over the model's layers; (dense
    layer, 0) for a dense model."""
    dense = layer_params(m)
    if not m.is_moe:
        return float(dense), 0.0
    x = moe_fraction(m)
    replicated, experts = _moe_params(m)
    mlp = _mlp_params(m, m.ffn_hidden_size)
    return dense - x * mlp + x * replicated, x * experts


def model_layer_params(m: ModelSpec) -> int:
    """Parameters of all the transformer layers, layer by layer (exact for a mixed pattern)."""
    dense = layer_params(m)
    if not m.is_moe:
        return m.num_layers * dense
    moe = dense - _mlp_params(m, m.ffn_hidden_size) + sum(_moe_params(m))
    pattern = m.moe_layer_pattern
    return sum(pattern) * moe + (len(pattern) - sum(pattern)) * dense


def embedding_params(m: ModelSpec, tp: int = 1) -> int:
    """Parameters of the input embedding (and learned positions) on the first stage."""
    n = padded_vocab_size(m, tp) * m.hidden_size
    if m.position_embedding_type == "learned_absolute":
        n += m.seq_length * m.hidden_size
    return n


def output_params(m: ModelSpec, tp: int = 1, *, single_stage: bool = False) -> int:
    """Parameters on the last stage after the layers: final norm and output layer. With tied
    embeddings Megatron still keeps a copy of the word embeddings there unless PP = 1."""
    n = m.hidden_size if m.normalization == "RMSNorm" else 2 * m.hidden_size
    if m.untie_embeddings_and_output_weights or not single_stage:
        n += padded_vocab_size(m, tp) * m.hidden_size
    return n


def layer_input_bytes(m: ModelSpec, b: int) -> float:
    """Bytes of one layer's 16-bit input (a pipeline send, a full-recompute checkpoint)."""
    return 2.0 * b * m.seq_length * m.hidden_size


def layer_activation_bytes(m: ModelSpec, b: int, tp: int, policy: Policy, *,
                           flash_attention: bool = False, sequence_parallel: bool = False) -> float:
    """Activation bytes one tensor rank keeps for one layer and one micro-batch (module doc).
    With sequence parallelism the replicated terms (and the full-recompute checkpoint) are
    sharded over ``tp`` too (Korthikanti's ``sbh(34/t + 5as/(ht))``)."""
    s, h, f, a = m.seq_length, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    if policy == "full":
        return layer_input_bytes(m, b) / (tp if sequence_parallel else 1)
    sbh = s * b * h
    replicated = 10.0 * sbh / (tp if sequence_parallel else 1)
    mlp = (6.0 if m.swiglu else 4.0) * s * b * f
    if m.is_moe:
        x, k, fe = moe_fraction(m), m.moe_router_topk, m.expert_ffn_hidden_size
        per = 6.0 if m.swiglu else 4.0
        moe = (4.0 * s * b * m.num_experts + 2.0 * s * b * k * h + per * s * b * k * fe
               + per * s * b * (m.moe_shared_expert_intermediate_size or 0))
        mlp = (1.0 - x) * mlp + x * moe
    sbq = s * b * _q(m)
    sharded = 2.0 * sbq + 4.0 * s * b * _kv(m) + 2.0 * sbq + mlp
    total = replicated + sharded / tp
    if policy == "none" and not flash_attention:
        total += 5.0 * a * s * s * b / tp
    return total


def module_input_bytes(m: ModelSpec, b: int, tp: int, *, sequence_parallel: bool = False) -> float:
    """The part of :func:`layer_activation_bytes` (policy ``none`` or ``selective``) that
    megatron-core's fine-grained activation offloading moves to the host when it offloads the
    inputs of ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj`` and ``mlp_norm``:
    the two LayerNorm inputs and the QKV input (replicated, 6sbh; sharded with sequence
    parallelism), Q, K and V and the projection input (sharded over t, 4sb*h_q + 4sb*h_kv). The
    MLP's own activations and the dropout masks stay."""
    s, h = m.seq_length, m.hidden_size
    sbh = s * b * h
    return 6.0 * sbh / (tp if sequence_parallel else 1) + (4.0 * s * b * _q(m)
                                                           + 4.0 * s * b * _kv(m)) / tp


def logits_bytes(m: ModelSpec, b: int, tp: int) -> float:
    """fp32 logits one tensor rank keeps for the loss (last stage)."""
    return 4.0 * b * m.seq_length * padded_vocab_size(m, tp) / tp
