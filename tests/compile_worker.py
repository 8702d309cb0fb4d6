"""Run in a child process (`python tests/compile_worker.py STAGE...`): for each ZeRO stage given, 5
updates of a tiny OPT-style model through `Trainer.train_step`, eager and with `--compile-layers`,
from the same weights on the same batches, fp32, no dropout. Prints one JSON line
`COMPILE {stage: {"eager": losses, "compiled": losses, "graphs": .., "graph_breaks": {..}, "frames": ..}}`
with dynamo's counts for the compiled run."""

import json
import sys

import torch

from metaseq_ds import criterions
from metaseq_ds.data import Dictionary
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed.deepspeed_config import build_deepspeed_config
from metaseq_ds.distributed.materialize import build_model
from metaseq_ds.models.initialization import InitialValues
from metaseq_ds.options import parse_train_config
from metaseq_ds.tasks import BaseTask
from metaseq_ds.trainer import Trainer

VOCAB = 96
LAYERS = 3


class RandomTokensTask(BaseTask):
    dictionary = source_dictionary = target_dictionary = Dictionary.of_size(VOCAB)


def flags(stage: int, compiled: bool):
    return [
        "--arch", "transformer_lm", "--decoder-embed-dim", "32", "--decoder-layers", str(LAYERS),
        "--decoder-attention-heads", "4", "--decoder-ffn-embed-dim", "64", "--decoder-learned-pos",
        "--decoder-normalize-before", "--share-decoder-input-output-embed", "--no-scale-embedding",
        "--dropout", "0.0", "--tokens-per-sample", "16", "--batch-size", "2", "--final-vocab-size", str(VOCAB),
        "--optimizer", "adam", "--lr", "1e-2", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1",
        "--adam-impl", "torch", "--zero-stage", str(stage), *(["--compile-layers"] if compiled else []),
    ]


def losses(stage: int, compiled: bool):
    cfg = parse_train_config(flags(stage, compiled))
    torch.manual_seed(cfg.common.seed)  # as `mseq train` does
    task = RandomTokensTask(cfg.task)
    criterion = criterions.build_criterion(cfg.criterion, task)
    ds_config = build_deepspeed_config(cfg, 1, fp16_supported=False, overlaps_communication=False)
    zero3 = ds_config if stage == 3 else None
    model = build_model(cfg, task, criterion, lambda model: InitialValues(model, model.init_seed), zero3)
    trainer = Trainer(cfg, task, model, criterion, ds_config)
    out = []
    for step in range(5):
        tokens = torch.randint(4, VOCAB, (2, 17), generator=torch.Generator().manual_seed(step))
        sample = {"net_input": {"src_tokens": tokens[:, :-1].contiguous()}, "target": tokens[:, 1:].contiguous(),
                  "ntokens": 32, "nsentences": 2}
        out.append(float(trainer.train_step([sample])["loss"]))
    return out


def main() -> None:
    from torch._dynamo.utils import counters

    dist_utils.init_distributed()
    result = {}
    for stage in map(int, sys.argv[1:]):
        eager = losses(stage, compiled=False)
        torch._dynamo.reset()
        counters.clear()
        compiled = losses(stage, compiled=True)
        result[stage] = {"eager": eager, "compiled": compiled, "graphs": counters["stats"]["unique_graphs"],
                         "graph_breaks": dict(counters["graph_break"]), "frames": counters["frames"]["total"]}
    print("COMPILE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
