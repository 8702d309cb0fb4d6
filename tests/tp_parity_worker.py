"""Run on 2 ranks (`deepspeed --num_gpus 2 tests/tp_parity_worker.py`): a TP=2 copy of a tiny
model against the unsharded model on the same weights and batch. Rank 0 prints one JSON line
`TP_PARITY {...}` with the largest differences of logits, losses and gradients."""

import copy
import json

import torch

from metaseq_ds.criterions import CrossEntropyCriterion
from metaseq_ds.model_parallel.criterions import VocabParallelCrossEntropyCriterion
from metaseq_ds.data import Dictionary
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed.tensor_parallel import apply_tensor_parallel, partition_dim
from metaseq_ds.models import TransformerLanguageModel, TransformerLanguageModelConfig


class Task:
    dictionary = target_dictionary = Dictionary.of_size(48)  # a multiple of 8 * 2: no padding question here


def tiny_tied_config() -> TransformerLanguageModelConfig:
    """Two pre-LN layers of width 32 over Task's 48 tokens, the embedding tied to the output."""
    return TransformerLanguageModelConfig(
        decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_layers=2, decoder_attention_heads=4,
        decoder_learned_pos=True, decoder_normalize_before=True, share_decoder_input_output_embed=True,
        no_scale_embedding=True, max_target_positions=32, dropout=0.0,
    )


def sample():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 48, (3, 17), generator=generator)
    tokens[2, 12:] = Task.dictionary.pad()  # a padded row: ignored targets
    return {"net_input": {"src_tokens": tokens[:, :-1].contiguous()}, "target": tokens[:, 1:].contiguous(),
            "ntokens": int(tokens[:, 1:].ne(Task.dictionary.pad()).sum())}


def saved_weight_views(model, batch) -> int:
    """How many tensors the forward saves for the backward that are views of a parameter's data:
    ZeRO-3 frees a gathered weight after the forward by swapping the parameter's data, which a
    view would keep alive until the backward."""
    params = {id(p) for p in model.parameters()}
    views = []

    def pack(tensor):
        if tensor._base is not None and id(tensor._base) in params:
            views.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch["net_input"])
    return len(views)


def loss_and_grads(model, criterion, batch):
    model.zero_grad()
    loss, _, _ = criterion(model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def main():
    dist_utils.init_distributed(tensor_parallel_size=2)
    tp_rank = dist_utils.get_tensor_model_parallel_rank()
    cfg = tiny_tied_config()
    torch.manual_seed(0)
    plain = TransformerLanguageModel.build_model(cfg, Task())
    batch = sample()
    ce = CrossEntropyCriterion(Task())
    plain_logits = plain(**batch["net_input"])[0].detach()
    plain_loss, plain_grads = loss_and_grads(plain, ce, batch)

    diffs = {}
    for name, criterion_cls, gather in (("cross_entropy", CrossEntropyCriterion, True),
                                        ("vocab_parallel_cross_entropy", VocabParallelCrossEntropyCriterion, False)):
        sharded = apply_tensor_parallel(copy.deepcopy(plain), gather_logits=gather)
        diffs["saved_weight_views"] = diffs.get("saved_weight_views", 0) + saved_weight_views(sharded, batch)
        logits = sharded(**batch["net_input"])[0].detach()
        if gather:
            diffs["logits"] = float((logits - plain_logits).abs().max())
        else:
            shard = logits.size(-1)
            diffs["logit_shard"] = float((logits - plain_logits[..., tp_rank * shard:(tp_rank + 1) * shard]).abs().max())
        loss, grads = loss_and_grads(sharded, criterion_cls(Task()), batch)
        diffs[f"loss[{name}]"] = float((loss - plain_loss).abs() / plain_loss.abs())
        worst = 0.0
        for param_name, grad in grads.items():
            expected = plain_grads[param_name]
            dim = partition_dim(param_name)
            if dim is not None:
                expected = expected.chunk(2, dim=dim)[tp_rank]
            worst = max(worst, float((grad - expected).abs().max()))
        diffs[f"grad[{name}]"] = worst
        diffs["sharded_q_proj_rows"] = sharded.decoder.layers[0].self_attn.q_proj.weight.shape[0]
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, diffs)
    dropout = dropout_masks(cfg, batch)
    both = [None, None]
    torch.distributed.all_gather_object(both, dropout)
    if dist_utils.get_global_rank() == 0:
        worst = {key: max(d[key] for d in gathered) for key in diffs}
        worst["replicated_logits_equal_across_tp_ranks"] = torch.equal(both[0]["logits"], both[1]["logits"])
        worst["ffn_dropout_masks_differ_across_tp_ranks"] = not torch.equal(both[0]["ffn_mask"], both[1]["ffn_mask"])
        print("TP_PARITY " + json.dumps(worst), flush=True)


def dropout_masks(cfg, batch):
    """Train-mode forward with every dropout on: the (replicated) logits and this rank's FFN dropout mask."""
    cfg.dropout = cfg.attention_dropout = cfg.activation_dropout = 0.2
    torch.manual_seed(0)
    model = apply_tensor_parallel(TransformerLanguageModel.build_model(cfg, Task())).train()
    masks = []
    model.decoder.layers[0].activation_dropout.register_forward_hook(lambda module, inputs, output: masks.append(output.eq(0)))
    torch.manual_seed(3)  # what the trainer does: the same seed on one tensor-parallel group's ranks
    logits = model(**batch["net_input"])[0].detach()
    return {"logits": logits, "ffn_mask": masks[0]}


if __name__ == "__main__":
    main()
