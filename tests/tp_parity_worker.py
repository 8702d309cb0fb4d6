"""Run on 2 ranks (`deepspeed --num_gpus 2 tests/tp_parity_worker.py`): a TP=2 copy of a tiny
model against the unsharded model on the same weights and batch, its output embedding tied and
untied. Rank 0 prints one JSON line `TP_PARITY {...}` with the largest differences of logits,
losses and gradients, and what the training loss kept for the backward.

The criteria take the loss from the model, fused with the vocabulary-parallel projection
(`modules.cross_entropy.vocab_parallel_linear_cross_entropy`), in chunks of fewer rows than the
batch has; the reference is the unsharded model's logits and their cross entropy."""

import copy
import dataclasses
import json
import math

import torch

from metaseq_ds.criterions import CrossEntropyCriterion
from metaseq_ds.model_parallel.criterions import VocabParallelCrossEntropyCriterion
from metaseq_ds.data import Dictionary
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed.tensor_parallel import apply_tensor_parallel, partition_dim
from metaseq_ds.models import TransformerLanguageModel, TransformerLanguageModelConfig
from metaseq_ds.modules import cross_entropy as cross_entropy_module
from metaseq_ds.modules.cross_entropy import cross_entropy

VOCAB = 48
CHUNK_ROWS = 7  # rows of a chunk of the fused loss on a rank's 24 words: the batch's 48 rows in 7 chunks


class Task:
    dictionary = target_dictionary = Dictionary.of_size(VOCAB)  # a multiple of 8 * 2: no padding question here


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


def train_step(model, criterion, batch, reduce: bool):
    """A forward and backward of the criterion's summed loss: its value, the logged one, the
    gradients, and how many tensors the forward saves for the backward with a row per target and
    a column per word (all or one rank's): logits, or what a loss makes of them. reduce=False
    takes both criteria's logits path (the model makes the logits, whole or this rank's shard)."""
    model.zero_grad()
    rows, shapes = batch["target"].numel(), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
        loss, _, logging_output = criterion(model, batch, reduce=reduce)
    loss = loss.sum()
    loss.backward()
    logits_like = sum(1 for shape in shapes if shape[-1] in (VOCAB, VOCAB // 2) and math.prod(shape[:-1]) == rows)
    return loss.detach(), logging_output["loss"], {name: p.grad.clone() for name, p in model.named_parameters()}, logits_like


def off(value, reference) -> float:
    """The largest |value - reference|, relative to the reference's largest magnitude where that
    is over 1: a sum of fp32 terms rounds to its own scale, so the summed biases' gradients (~9)
    differ by an ulp of 9 (1e-6) where another order sums them, and the key biases' (0 up to
    rounding) are compared absolutely."""
    value, reference = torch.as_tensor(value).double(), torch.as_tensor(reference).double()
    return float((value - reference).abs().max() / max(1.0, float(reference.abs().max())))


def head_against_its_logits(head) -> dict:
    """The TP head alone on (N, C) features: its fused loss against its own gathered logits'
    cross entropy (`head` gathers them): losses, the features' gradient, the weight shard's."""
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(20, head.weight.size(1), generator=generator)
    target = torch.randint(0, VOCAB, (20,), generator=generator)
    target[[3, 11]] = Task.dictionary.pad()
    results, fused_losses = [], [None, None]
    for fused in (True, False):
        x = features.clone().requires_grad_()
        head.weight.grad = None
        if fused:
            loss, losses = head(x, target=target, ignore_index=Task.dictionary.pad())
        else:
            losses = cross_entropy(head(x), target, ignore_index=Task.dictionary.pad())
            loss = losses.sum()
        (loss * 0.37).backward()
        results.append((loss.detach(), losses.detach(), x.grad, head.weight.grad.clone()))
    (loss, losses, x_grad, w_grad), (loss_ref, losses_ref, x_grad_ref, w_grad_ref) = results
    torch.distributed.all_gather_object(fused_losses, losses)
    return {"head_loss": off(loss, loss_ref), "head_losses": off(losses, losses_ref),
            "head_losses_equal_across_tp_ranks": torch.equal(*fused_losses),
            "head_pad_losses": float(losses[[3, 11]].abs().max()),
            "head_features_grad": off(x_grad, x_grad_ref), "head_weight_shard_grad": off(w_grad, w_grad_ref),
            "head_weight_shard_rows": head.weight.size(0)}


def parity(tied: bool, batch, tp_rank: int) -> dict:
    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny_tied_config(), share_decoder_input_output_embed=tied)
    plain = TransformerLanguageModel.build_model(cfg, Task())
    plain_logits = plain(**batch["net_input"])[0].detach()
    plain_loss, _, plain_grads, _ = train_step(plain, CrossEntropyCriterion(Task()), batch, reduce=False)
    diffs = {}
    for name, criterion_cls, gather in (("cross_entropy", CrossEntropyCriterion, True),
                                        ("vocab_parallel_cross_entropy", VocabParallelCrossEntropyCriterion, False)):
        sharded = apply_tensor_parallel(copy.deepcopy(plain), gather_logits=gather)
        criterion = criterion_cls(Task())
        diffs["saved_weight_views"] = diffs.get("saved_weight_views", 0) + saved_weight_views(sharded, batch)
        logits = sharded(**batch["net_input"])[0].detach()
        if gather:
            diffs["logits"] = float((logits - plain_logits).abs().max())
            diffs.update(head_against_its_logits(sharded.decoder.output_projection))
        else:
            shard = logits.size(-1)
            diffs["logit_shard"] = float((logits - plain_logits[..., tp_rank * shard:(tp_rank + 1) * shard]).abs().max())
        loss, logged, grads, diffs[f"logits_like_saved[{name}]"] = train_step(sharded, criterion, batch, reduce=True)
        # The same sharded model through the logits (gathered, or DeepSpeed's loss on the shards)
        ref_loss, ref_logged, ref_grads, diffs[f"logits_like_saved_by_logits_path[{name}]"] = train_step(
            sharded, criterion, batch, reduce=False)
        diffs[f"loss[{name}]"] = off(loss, ref_loss)
        diffs[f"logged_loss[{name}]"] = off(logged, ref_logged)
        diffs[f"grad[{name}]"] = max(off(grads[param], ref_grads[param]) for param in grads)
        # ... and the unsharded model's (its sums in another order: the row-parallel layers')
        diffs[f"unsharded_loss[{name}]"] = off(loss, plain_loss)
        worst = 0.0
        for param_name, grad in grads.items():
            expected = plain_grads[param_name]
            dim = partition_dim(param_name)
            if dim is not None:
                expected = expected.chunk(2, dim=dim)[tp_rank]
            worst = max(worst, off(grad, expected))
        diffs[f"unsharded_grad[{name}]"] = worst
        diffs["sharded_q_proj_rows"] = sharded.decoder.layers[0].self_attn.q_proj.weight.shape[0]
    return {f"{key}[{'tied' if tied else 'untied'}]": value for key, value in diffs.items()}


def main():
    dist_utils.init_distributed(tensor_parallel_size=2)
    tp_rank = dist_utils.get_tensor_model_parallel_rank()
    cross_entropy_module.CHUNK_ELEMENTS = CHUNK_ROWS * VOCAB // 2
    batch = sample()
    diffs = {**parity(True, batch, tp_rank), **parity(False, batch, tp_rank)}
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, diffs)
    dropout = dropout_masks(tiny_tied_config(), batch)
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
