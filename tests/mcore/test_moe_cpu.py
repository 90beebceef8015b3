"""megatron-core's mixture-of-experts layer on CPU ranks: expert parallelism over gloo equals one
process.

Two ranks of expert-parallel size 2 each read their own micro-batch and hold half of the experts
(the expert-parallel group is carved out of data parallelism, as in Megatron). One process holds
every expert and reads both micro-batches. With dropless routing (no capacity factor) and the
same weights, each rank's loss equals the one process's loss on that micro-batch, each expert's
gradient equals the one process's (its tokens come from both ranks through the dispatcher), and
the dense gradients of the two ranks sum to the one process's. The router's load-balancing loss
is on, so its backward runs too.
"""

from __future__ import annotations

import pytest

from megatron_hetero.mcore.spawn import spawn

EXPERTS, LAYERS, SEQ, VOCAB = 4, 2, 16, 64


def _moe_rank(rank, world_size, dispatcher, state, batches):
    import torch

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    enable_cpu_backend()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    ep = world_size
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS,
                                                                     moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    local = EXPERTS // ep

    def global_name(name):  # local expert i of EP rank r is global expert r * local + i
        marker = ".local_experts."
        if marker not in name:
            return name
        head, tail = name.split(marker)
        index, rest = tail.split(".", 1)
        return f"{head}{marker}{rank * local + int(index)}.{rest}"

    if state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[global_name(name)])
    mine = batches if state is None else [batches[rank]]
    losses = []
    for tokens in mine:
        position_ids = torch.arange(SEQ).expand_as(tokens)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        losses.append(loss.item())
    grads = {global_name(n): p.main_grad.clone() if getattr(p, "main_grad", None) is not None
             else p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {global_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_ranks_equal_one_process(dispatcher):
    import torch

    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (2, SEQ), generator=generator) for _ in range(2)]
    [one] = spawn(_moe_rank, 1, args=(dispatcher, None, batches))
    ranks = spawn(_moe_rank, 2, args=(dispatcher, one["params"], batches))

    assert [r["losses"][0] for r in ranks] == pytest.approx(one["losses"], rel=1e-5)
    expert = [n for n in one["grads"] if ".local_experts." in n]
    dense = [n for n in one["grads"] if n not in expert]
    assert len(expert) == EXPERTS * LAYERS * 2 and dense  # fc1 and fc2 of every expert
    for name in expert:  # each expert lives on one rank and sees both ranks' tokens
        [held] = [r["grads"][name] for r in ranks if name in r["grads"]]
        torch.testing.assert_close(held, one["grads"][name], rtol=1e-5, atol=1e-7)
    for name in dense:  # router, attention, norms, embedding: the ranks' sum (data parallel)
        torch.testing.assert_close(ranks[0]["grads"][name] + ranks[1]["grads"][name],
                                   one["grads"][name], rtol=1e-5, atol=1e-7)
    assert any(one["grads"][n].abs().max() > 0 for n in dense if ".router." in n)
