"""Run on 2 ranks (`deepspeed --num_gpus 2 tests/tied_embedding_worker.py`): ZeRO-3 with a tied
embedding read a chunk at a time and whose gradient is added after the backward
(`distributed.tied_embedding`), against plain autograd on one process. Rank 0 prints one JSON
line `TIED {...}`: per case, the largest difference of any loss and of any full gradient (of an
update's micro-batches, after an earlier update) from the reference, the most elements of
the tied weight any rank held gathered during its forwards, and whether the loss was fused
(chunks of whole rows) or taken of the logits (chunks that cut rows)."""

import copy
import json

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad

from metaseq_ds.criterions import CrossEntropyCriterion
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed import tied_embedding
from metaseq_ds.distributed.tied_embedding import stream_tied_embedding
from metaseq_ds.models import TransformerLanguageModel
from tp_parity_worker import Task, tiny_tied_config


def batch(rank: int, micro_step: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(100 * rank + micro_step)
    tokens = torch.randint(4, 48, (rows, 17), generator=generator)
    tokens[-1, 12:] = Task.dictionary.pad()  # padding: no target, and the padding row gets no gradient
    return {"net_input": {"src_tokens": tokens[:, :-1].contiguous()}, "target": tokens[:, 1:].contiguous(),
            "ntokens": int(tokens[:, 1:].ne(Task.dictionary.pad()).sum())}


def reference_grads(plain, criterion, micro_steps: int, rows: int):
    """What DeepSpeed's data parallelism computes for the second update: the mean over ranks and
    micro-steps; and each rank's losses."""
    model = copy.deepcopy(plain)
    losses = {}
    for rank in range(2):
        for step in range(micro_steps):
            loss, _, _ = criterion(model, batch(rank, step + 10, rows))  # the second update's batches
            (loss / (2 * micro_steps)).backward()
            losses[rank, step] = float(loss)
    return {name: p.grad for name, p in model.named_parameters()}, losses


def zero3_grads(plain, criterion, micro_steps: int, rows: int, bf16: bool, recompute_loss: bool):
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": micro_steps,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
    model = copy.deepcopy(plain)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    tied = stream_tied_embedding(engine, recompute_loss)
    decoder = engine.module.decoder
    held = [0]  # the most elements of W seen gathered in the forwards of its modules and the head's backward

    def record(*_):  # reads W through `tied`: reading it through a module in a forward makes ZeRO-3 gather it
        held[0] = max(held[0], tied.weight.numel())

    for module in (decoder.embed_tokens, decoder.output_projection):
        module.register_forward_hook(record)
    keep_projection = tied.keep_projection
    tied.keep_projection = lambda *args: (record(), keep_projection(*args))
    rank = dist_utils.get_global_rank()
    losses = {}
    for update in range(2):  # the second update's gradient must not carry the first's
        for step in range(micro_steps):
            loss, _, _ = criterion(engine, batch(rank, step + 10 * update, rows))
            engine.backward(loss)
            tied.add_to_gradient_partition(first_micro_step=step == 0)
            losses[rank, step] = float(loss)  # the second update's remain
            if update == 0 or step < micro_steps - 1:
                engine.step()  # as the trainer does after each micro-batch; lr 0 keeps the weights
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, losses)
    all_losses = {key: value for part in gathered for key, value in part.items()}
    grads = {name: safe_get_full_grad(p).float() for name, p in engine.module.named_parameters()}
    return grads, all_losses, held[0], decoder.fuses_output_loss()


def main():
    dist_utils.init_distributed()
    torch.manual_seed(0)
    plain = TransformerLanguageModel.build_model(tiny_tied_config(), Task())
    criterion = CrossEntropyCriterion(Task())
    report = {}
    # chunks of 50 elements: 25 of each rank's 768-element partition of W (48 x 32), across rows;
    # of 64: one row of each rank's; "one_row" keeps the defaults, under which W's partitions are
    # small enough to come whole.
    whole = (tied_embedding.CHUNK_ELEMENTS, tied_embedding.MIN_SLICE_ELEMENTS)
    # all but the "..._logits_kept" ones recompute the loss (as under --checkpoint-activations)
    for case, micro_steps, rows, (chunk, min_slice), bf16 in (
            ("one_row", 1, 1, whole, False), ("three_rows_small_chunks", 1, 3, (50, 1), False),
            ("three_rows_chunks_of_whole_rows", 1, 3, (64, 1), False), ("whole_rows_logits_kept", 1, 3, (64, 1), False),
            ("one_row_2_micro_steps", 2, 1, (50, 1), False), ("bf16_three_rows_small_chunks", 1, 3, (50, 1), True),
            ("whole_rows_2_micro_steps", 2, 3, (64, 1), False), ("bf16_whole_rows", 1, 3, (64, 1), True),
            ("small_chunks_logits_kept", 1, 3, (50, 1), False), ("bf16_whole_rows_logits_kept", 1, 3, (64, 1), True)):
        tied_embedding.CHUNK_ELEMENTS, tied_embedding.MIN_SLICE_ELEMENTS = chunk, min_slice
        expected, expected_losses = reference_grads(plain, criterion, micro_steps, rows)
        got, losses, held, fused = zero3_grads(plain, criterion, micro_steps, rows, bf16,
                                               recompute_loss=not case.endswith("logits_kept"))
        embedding = expected["decoder.embed_tokens.weight"]
        report[case] = {"fused": fused,
                        "loss_worst": max(abs(losses[key] / value - 1) for key, value in expected_losses.items()),
                        "weight_held": held,
                        "worst": max(float((got[name] - grad).abs().max()) for name, grad in expected.items()),
                        "embedding_worst": float((got["decoder.embed_tokens.weight"] - embedding).abs().max()),
                        "embedding_grad_norm": float(embedding.norm()), "embedding_grad_max": float(embedding.abs().max())}
    if dist_utils.get_global_rank() == 0:
        print("TIED " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
