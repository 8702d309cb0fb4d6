"""One side of the training benchmark in one process (or one rank): metaseq_ds or Hugging Face.

    python -m benchmarks.train_worker --side ours --dtype bf16 --out DIR [--steps 10 --warmup 1]
    deepspeed --num_gpus 2 --module benchmarks.train_worker --side hf --dtype fp32 --out DIR

`benchmarks/train.py` runs it; it is not meant to be called by hand. Both sides get the DeepSpeed
config that metaseq_ds derives from the same flags (`build_deepspeed_config`), the same torch
AdamW hyper-parameters (both on torch's fused AdamW kernel on the CPU) and the same random
tokens, step by step. Ours runs the production
pieces: `Trainer.train_step` (our model, cross_entropy criterion, loss normalisation); Hugging
Face runs `OPTForCausalLM(attn_implementation="sdpa")` with `labels=input_ids` on a DeepSpeed
engine, as its users write it. Each rank writes `<side>.rank<r>.json`: seconds per step, loss,
peak RSS and, under ZeRO-3, the bytes of model state it holds.
"""

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from benchmarks.peak_memory import peak_memory
from metaseq_ds.data import Dictionary
from metaseq_ds.tasks import BaseTask

VOCAB = 50272
DEFAULTS = dict(dim=512, layers=8, heads=8, ffn=2048, seq=512, batch=4)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say what is trained: model size, batch, ZeRO stage, our Adam kernel."""
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--zero-stage", type=int, help="default: metaseq_ds's (0 for one rank, 3 for several)")
    parser.add_argument("--adam-impl", default="auto",
                        help="metaseq_ds's --adam-impl (HF runs torch AdamW, as its users do)")
    parser.add_argument("--compile-layers", action="store_true",
                        help="metaseq_ds: mseq train's --compile-layers (each decoder layer compiled; the HF "
                             "side compiled alike is the side hf_compiled)")


def run_flags(args) -> List[str]:
    """`add_run_arguments`' values as flags again, to pass on to a worker."""
    flags = [f"--{name}={getattr(args, name)}" for name in DEFAULTS] + [f"--adam-impl={args.adam_impl}"]
    flags += ["--compile-layers"] if args.compile_layers else []
    return flags + ([f"--zero-stage={args.zero_stage}"] if args.zero_stage is not None else [])


def train_flags(args) -> List[str]:
    """The `mseq train` flags of the benchmarked run (an OPT recipe at the chosen size)."""
    flags = [
        "--arch", "transformer_lm", "--decoder-embed-dim", str(args.dim), "--decoder-layers", str(args.layers),
        "--decoder-attention-heads", str(args.heads), "--decoder-ffn-embed-dim", str(args.ffn),
        "--decoder-learned-pos", "--decoder-normalize-before", "--share-decoder-input-output-embed",
        "--no-scale-embedding", "--activation-fn", "relu", "--dropout", "0.1", "--attention-dropout", "0.0",
        "--tokens-per-sample", str(args.seq), "--batch-size", str(args.batch), "--final-vocab-size", str(VOCAB),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.95)", "--weight-decay", "0.1", "--clip-norm", "1.0",
        "--lr", "1e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1", "--adam-impl", args.adam_impl,
    ]
    if args.zero_stage is not None:
        flags += ["--zero-stage", str(args.zero_stage)]
    if args.dtype == "bf16":
        flags.append("--bf16")
    if args.compile_layers:
        flags.append("--compile-layers")
    return flags


def batches(args, steps: int):
    """The same (B, T + 1) random tokens for both sides: step i draws from seed i."""
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 + step)
        yield torch.randint(4, VOCAB, (args.batch, args.seq + 1), generator=generator)


class RandomTokensTask(BaseTask):
    """The language-modeling task's model-facing side, without a corpus: the batches are given."""

    dictionary = Dictionary.of_size(VOCAB)
    source_dictionary = target_dictionary = dictionary


StepFn = Callable[[torch.Tensor], float]  # (B, T + 1) tokens -> the step's mean loss in nats


def our_step_fn(cfg, args, ds_config) -> Tuple[StepFn, object]:
    """`mseq train`'s construction (meta device, materialised rank by rank) and `Trainer.train_step`."""
    from metaseq_ds import criterions
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.trainer import Trainer

    task = RandomTokensTask(cfg.task)
    criterion = criterions.build_criterion(cfg.criterion, task)
    zero3_config = ds_config if ds_config["zero_optimization"]["stage"] == 3 else None
    model = build_model(cfg, task, criterion, lambda model: InitialValues(model, model.init_seed), zero3_config)
    trainer = Trainer(cfg, task, model, criterion, ds_config)

    def step(tokens: torch.Tensor) -> float:
        sample = {  # as the data pipeline makes them (document_blocks.collate)
            "net_input": {"src_tokens": tokens[:, :-1].contiguous()},
            "target": tokens[:, 1:].contiguous(),
            "ntokens": tokens[:, 1:].numel(),
            "nsentences": tokens.size(0),
        }
        return float(trainer.train_step([sample])["loss"]) * math.log(2)  # bits -> nats, as HF reports

    return step, trainer.engine


def hf_step_fn(cfg, args, ds_config, compiled: bool = False) -> Tuple[StepFn, object]:
    import deepspeed
    from transformers import OPTForCausalLM

    from metaseq_ds.models.hf_opt import to_hf_config

    hf_config = to_hf_config(cfg.model, vocab_size=VOCAB)
    model = OPTForCausalLM._from_config(hf_config, attn_implementation="sdpa")
    if compiled:
        compile_each(model.model.decoder.layers)
    opt = cfg.optimizer
    # torch's fused AdamW kernel: what Hugging Face's Trainer picks by default with torch >= 2.8.
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.adam_betas), eps=opt.adam_eps,
                                  weight_decay=opt.weight_decay, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    def step(tokens: torch.Tensor) -> float:
        input_ids = tokens[:, :-1].to(engine.device)
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, engine


SIDES = ("ours", "hf", "hf_compiled")


def step_fn(side: str, cfg, args, ds_config) -> Tuple[StepFn, object]:
    if side == "ours":
        return our_step_fn(cfg, args, ds_config)
    return hf_step_fn(cfg, args, ds_config, compiled=side == "hf_compiled")


def compile_each(layers) -> None:
    """Regional compilation, as torch recommends for transformers: each layer compiled in place
    (one graph, reused by every layer of the same shape); compiled at the first (warm-up) step."""
    for layer in layers:
        layer.compile()


class Turns:
    """Steps on cue: `benchmarks/train.py` creates `go.<step>.<side>` and waits for `done.<step>.<side>`,
    so the two sides, running side by side, alternate step by step and never compute at once."""

    def __init__(self, folder: Path, side: str, rank: int):
        self.folder, self.side, self.rank = folder, side, rank

    def announce(self, event: str) -> None:
        if self.rank == 0:
            (self.folder / f"{event}.{self.side}").touch()

    def wait(self, step: int) -> None:
        go = self.folder / f"go.{step}.{self.side}"
        while not go.exists():
            time.sleep(0.005)

    def done(self, step: int) -> None:
        self.announce(f"done.{step}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, required=True, help="hf_compiled: HF with each decoder layer compiled")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the turn files and rank<r>.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    add_run_arguments(parser)
    args = parser.parse_args()

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.options import parse_train_config

    dist_utils.init_distributed()
    args.world_size, rank = dist_utils.get_world_size(), dist_utils.get_global_rank()
    cfg = parse_train_config(train_flags(args))
    torch.manual_seed(cfg.common.seed)
    ds_config = build_deepspeed_config(cfg, args.world_size, **accelerator_traits())
    step, engine = step_fn(args.side, cfg, args, ds_config)
    turns = Turns(args.out, args.side, rank)
    dist_utils.barrier()
    turns.announce("ready")

    seconds, losses = [], []
    for index, tokens in enumerate(batches(args, args.warmup + args.steps)):
        turns.wait(index)
        start = time.perf_counter()
        losses.append(step(tokens))
        if index >= args.warmup:
            seconds.append(time.perf_counter() - start)
        dist_utils.barrier()
        turns.done(index)
    result: Dict = {
        "side": args.side, "dtype": args.dtype, "world_size": args.world_size, "rank": rank,
        "threads": torch.get_num_threads(), "seconds": seconds, "losses": losses,
        "tokens_per_step": args.batch * args.seq * args.world_size,
    }
    result["memory_kind"], result["peak_memory"] = peak_memory()
    if engine.zero_optimization_stage() == 3:
        from benchmarks.zero_memory import model_state_bytes

        result["model_states"] = model_state_bytes(engine)
    (args.out / f"{args.side}.rank{rank}.json").write_text(json.dumps(result))
    dist_utils.barrier()


if __name__ == "__main__":
    main()
