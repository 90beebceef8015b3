"""A pretrain_gpt.py-style script: megatron.training.pretrain, tiny GPT, synthetic data."""
import inspect
import json
import os
from functools import partial

import torch

from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, pretrain
from megatron.training.arguments import core_transformer_config_from_args


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        text = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        return {"tokens": text[:-1], "labels": text[1:], "index": torch.tensor(i),
                "loss_mask": torch.ones(self.seq), "position_ids": torch.arange(self.seq)}


def model_provider(pre_process=True, post_process=True, vp_stage=None, **_):
    args = get_args()
    config = core_transformer_config_from_args(args)
    LOG["recompute"] = config.recompute_granularity
    LOG.setdefault("chunks", []).append(None)  # per model chunk: layers, recompute
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
            if args.num_experts else get_gpt_layer_local_spec())  # MoE: as pretrain_gpt.py
    model = GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, vp_stage=vp_stage)
    LOG.setdefault("layer_calls", 0)
    LOG["chunks"][-1] = [[layer.layer_number for layer in model.decoder.layers],
                         [config.recompute_granularity, config.recompute_num_layers]]
    for layer in model.decoder.layers:  # a recomputed layer runs forward twice per micro-batch
        layer.register_forward_hook(lambda *_: LOG.__setitem__("layer_calls",
                                                                LOG["layer_calls"] + 1))
    LOG["num_layers"] = LOG.get("num_layers", 0) + len(model.decoder.layers)
    return model


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    return Synthetic(max(64, num_samples[0]), args.seq_length, 100), None, None


LOG = {"indices": [], "losses": []}


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    LOG["losses"].append([loss.item(), num_tokens.item()])
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def _slow_down():
    """``TINY_SLOW=RANK:SECONDS:ITERATION``: Megatron rank RANK sleeps SECONDS in every forward
    from iteration ITERATION on (a card that slows down, for the rebalancing tests)."""
    spec = os.environ.get("TINY_SLOW")
    if not spec:
        return
    import time
    import torch.distributed as dist
    rank, seconds, start = spec.split(":")
    if dist.get_rank() == int(rank) and get_args().curr_iteration >= int(start):
        time.sleep(float(seconds))


def forward_step(data_iterator, model):
    _slow_down()
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # middle/last pipeline stages without data
        return model(None, None, attention_mask=None), partial(loss_func, None)
    LOG["indices"].append(batch["index"].tolist())
    if RECORD and get_attr_wrapped_model(model, "pre_process"):
        for i in batch["index"].tolist():  # the samples that enter the model here
            recording.read(i)  # (every chunk of an interleaved stage pulls its own batches)
    out = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    return out, partial(loss_func, batch["loss_mask"])


RECORD = bool(os.environ.get("SAMPLES_LOG"))  # recording.py's samples, steps and ranks

if __name__ == "__main__":
    datasets_provider.is_distributed = True
    if RECORD:
        import recording
        recording.record_steps()
        recording.record_offload()
    try:
        if "cfg_container" in inspect.signature(pretrain).parameters:
            # megatron-core 0.19: the arguments parsed first, pretrain given a config container
            # (without a model config: the model from model_provider through get_model)
            from megatron.training.argument_utils import pretrain_cfg_container_from_args
            from megatron.training.arguments import parse_and_validate_args

            args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
            pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
                     ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
        else:
            pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder,
                     forward_step, args_defaults={"tokenizer_type": "NullTokenizer"})
    finally:  # --exit-interval ends the run with sys.exit
        if RECORD:
            recording.dump()
    out = os.environ.get("TINY_LOG")
    if out:
        import torch.distributed as dist
        LOG["rank"] = dist.get_rank()
        from megatron_hetero.runtime import hooks
        runtime = hooks.installed()  # None in a plain Megatron run (no hooks)
        groups = getattr(runtime.backend, "vendor_groups", None) if runtime else None
        router = groups.routes if groups else None  # across vendors: messages via host buffers
        if router is not None:
            LOG["staged"] = [router.staged_sends, router.staged_recvs]
        launcher = os.environ.get("MEGATRON_HETERO_LAUNCHER_RANK", os.environ["RANK"])
        with open(f"{out}.{launcher}", "w") as f:
            json.dump(LOG, f)
