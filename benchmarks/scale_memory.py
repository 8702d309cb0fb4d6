"""Peak RSS per rank while `mseq train`'s pieces build and train a 707M-parameter model, against
the theory of its model states per rank.

    python -m benchmarks.scale_memory                 # the three layouts below, one after the other
    python -m benchmarks.scale_memory --layouts zero3 # any of: zero3, tp2_zero1, tp2_dp2_zero3, generate_tp2

The model: width 2048, 12 layers, FFN 8192, vocabulary 50272 (706.7M parameters), fp32,
micro-batch 1, sequence 64. Each layout runs under `deepspeed --num_gpus N` on CPU ranks; each
rank records its peak RSS (`benchmarks.peak_memory`) after construction (the model built on the
meta device and materialised: `distributed.materialize.build_model`), after the DeepSpeed engine
is initialised (`Trainer`), after the first `Trainer.train_step` and after two more (ZeRO-3 gathers
parameters differently once it has traced a step). Theory: 16 bytes a parameter
(fp32 weights 4 + gradients 4 + Adam's two moments 8) times this rank's share of the parameters:

- zero3          2 ranks, ZeRO-3: N / 2 (everything partitioned over the 2 ranks)
- tp2_zero1      2 ranks, tensor-parallel 2, ZeRO-1 over a data-parallel group of 1: the TP share
- tp2_dp2_zero3  4 ranks, tensor-parallel 2 x data-parallel 2, ZeRO-3: N / 4

- generate_tp2   2 ranks generating from a weights-only checkpoint of the same model (written
                 first: `convert.weights_checkpoint`, as `mseq import` writes them) under
                 `deepspeed --num_gpus 2 --module metaseq_ds.cli.generate`'s code path: theory
                 4 bytes a parameter of the TP share (fp32 weights, nothing else)

The acceptance is peak <= 1.25 x theory over the whole run. Peaks include Python, torch and
DeepSpeed themselves (~0.25 GiB a rank on this machine: printed as the "base" line, the peak of
a rank that only imported them and joined the process group).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.peak_memory import peak_rss

LAYOUTS = {  # name: (ranks, tensor-parallel degree, ZeRO stage)
    "zero3": (2, 1, 3),
    "tp2_zero1": (2, 2, 1),
    "tp2_dp2_zero3": (4, 2, 3),
}
MODEL = dict(dim=2048, layers=12, heads=16, ffn=8192, seq=64, batch=1)
GENERATION = "generate_tp2"  # (2 ranks, tensor-parallel 2, no optimizer)
STEPS = 3  # the first step allocates Adam's moments; later ones run ZeRO-3's traced prefetching
GIB = 2**30


def theory_bytes(tp_share: float, data_parallel: int, stage: int) -> float:
    """fp32 weights 4 + gradients 4 + Adam 8 bytes a parameter of this rank's tensor-parallel
    share, each divided by the data-parallel size where the ZeRO stage partitions it."""
    weights = 4 / (data_parallel if stage == 3 else 1)
    gradients = 4 / (data_parallel if stage >= 2 else 1)
    adam = 8 / (data_parallel if stage >= 1 else 1)
    return tp_share * (weights + gradients + adam)


def worker(args) -> None:
    """One rank: build, initialise, one step; write its peaks to OUT/rank<r>.json."""
    import torch

    from benchmarks.train_worker import RandomTokensTask, batches, train_flags
    from metaseq_ds import criterions
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import parse_train_config
    from metaseq_ds.trainer import Trainer

    ranks, tp, stage = LAYOUTS[args.layout]
    run = argparse.Namespace(**MODEL, adam_impl="auto", zero_stage=stage, dtype="fp32")
    cfg = parse_train_config(train_flags(run) + ["--model-parallel-size", str(tp), "--dropout", "0"])
    dist_utils.init_distributed(tensor_parallel_size=tp)
    rank = dist_utils.get_global_rank()
    peaks = {"base": peak_rss()}
    torch.manual_seed(cfg.common.seed)
    task = RandomTokensTask(cfg.task)
    criterion = criterions.build_criterion(cfg.criterion, task)
    ds_config = build_deepspeed_config(cfg, ranks, **accelerator_traits())
    zero3_config = ds_config if stage == 3 else None
    model = build_model(cfg, task, criterion, lambda m: InitialValues(m, m.init_seed), zero3_config)
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # this rank's TP share
    peaks["construction"] = peak_rss()
    trainer = Trainer(cfg, task, model, criterion, ds_config)
    peaks["engine"] = peak_rss()
    for step, tokens in enumerate(batches(run, STEPS)):
        trainer.train_step([{"net_input": {"src_tokens": tokens[:, :-1].contiguous()}, "target": tokens[:, 1:].contiguous(),
                             "ntokens": tokens[:, 1:].numel(), "nsentences": tokens.size(0)}])
        peaks["first_step" if step == 0 else f"step_{step + 1}"] = peak_rss()
    (args.out / f"rank{rank}.json").write_text(json.dumps({"peaks": peaks, "tp_share_parameters": parameters}))
    dist_utils.barrier()


def generation_worker(args) -> None:
    """One rank of `mseq generate --path CKPT` under a launcher: load (this rank's TP shard only),
    complete one prompt; write its peaks to OUT/rank<r>.json."""
    import contextlib

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.generation_options import GenerationOptions
    from metaseq_ds.hub_utils import GeneratorInterface

    peaks = {"base": peak_rss()}
    with contextlib.redirect_stdout(sys.stderr):
        interface = GeneratorInterface(str(args.checkpoint))
        interface.load_model()
    peaks["loaded"] = peak_rss()
    interface.generate(["The benchmark prompt"], options=GenerationOptions(max_tokens=8, temperature=0))
    peaks["generated"] = peak_rss()
    parameters = sum(p.numel() for p in interface.model.parameters())  # this rank's TP share
    rank = dist_utils.get_global_rank()
    (args.out / f"rank{rank}.json").write_text(json.dumps({"peaks": peaks, "tp_share_parameters": parameters}))
    dist_utils.barrier()


def write_generation_checkpoint(folder: Path) -> Path:
    """A weights-only checkpoint of the benchmark model with random weights (as `mseq import`
    writes one: the byte tokenizer, no data directory)."""
    import torch

    from benchmarks.train_worker import RandomTokensTask, train_flags
    from metaseq_ds.convert.weights_checkpoint import write_weights_only_checkpoint
    from metaseq_ds.options import parse_train_config

    run = argparse.Namespace(**MODEL, adam_impl="auto", zero_stage=None, dtype="fp32")
    cfg = parse_train_config(train_flags(run) + ["--dropout", "0"])
    with torch.device("meta"):
        model = RandomTokensTask(cfg.task).build_model(cfg.model)
    generator = torch.Generator().manual_seed(0)
    values = {}
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in values:
            values[id(tensor)] = torch.randn(tensor.shape, generator=generator) * 0.02
        state[name] = values[id(tensor)]
    fields = {name: getattr(cfg.model, name) for name in (
        "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
        "decoder_normalize_before", "activation_fn", "share_decoder_input_output_embed", "decoder_learned_pos",
        "no_scale_embedding", "max_target_positions")}
    out = folder / "checkpoint"
    write_weights_only_checkpoint(out, state, {**fields, "dropout": 0.0, "attention_dropout": 0.0}, {},
                                  "benchmarks.scale_memory")
    return out


def run_layout(name: str, out: Path, checkpoint: Optional[Path] = None) -> dict:
    ranks = LAYOUTS[name][0] if name in LAYOUTS else 2
    worker_args = ["--layout", name] if checkpoint is None else ["--generation-worker", "--checkpoint", str(checkpoint)]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(29000 + os.getpid() % 1000), "--module", "benchmarks.scale_memory", "--worker", *worker_args,
           "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(reports) != ranks:
        raise SystemExit(f"{name}: {len(reports)} of {ranks} ranks reported\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return {"reports": reports, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=[*LAYOUTS, GENERATION], choices=[*LAYOUTS, GENERATION])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--generation-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    if args.worker:
        (generation_worker if args.generation_worker else worker)(args)
        return
    total = None
    print(f"model: width {MODEL['dim']}, {MODEL['layers']} layers, FFN {MODEL['ffn']}, vocab 50272, fp32, "
          f"batch {MODEL['batch']}, seq {MODEL['seq']}")
    for name in args.layouts:
        if name == GENERATION:
            report_generation()
            continue
        ranks, tp, stage = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as folder:
            measured = run_layout(name, Path(folder))
        shares = [r["tp_share_parameters"] for r in measured["reports"]]
        total = total or shares[0] * tp
        data_parallel = ranks // tp
        theory = theory_bytes(shares[0], data_parallel, stage)
        print(f"\n{name}: {ranks} ranks, tensor-parallel {tp}, ZeRO-{stage} ({measured['seconds']:.0f} s)")
        print(f"  theory: {theory / shares[0]:.0f} B x {shares[0] / 1e6:.1f}M params of the TP share = "
              f"{theory / GIB:.2f} GiB a rank")
        for rank, report in enumerate(measured["reports"]):
            peaks = report["peaks"]
            line = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in peaks.items())
            print(f"  rank {rank}: {line}; whole run {max(peaks.values()) / theory:.3f}x theory")
    if total:
        print(f"\nparameters: {total / 1e6:.1f}M")


def report_generation() -> None:
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_generation_checkpoint(Path(folder))
        (Path(folder) / "ranks").mkdir()
        measured = run_layout(GENERATION, Path(folder) / "ranks", checkpoint)
    share = measured["reports"][0]["tp_share_parameters"]
    theory = 4 * share
    print(f"\n{GENERATION}: 2 ranks, tensor-parallel 2, generating ({measured['seconds']:.0f} s)")
    print(f"  theory: 4 B x {share / 1e6:.1f}M params of the TP share = {theory / GIB:.2f} GiB a rank")
    for rank, report in enumerate(measured["reports"]):
        peaks = report["peaks"]
        line = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in peaks.items())
        print(f"  rank {rank}: {line}; whole run {max(peaks.values()) / theory:.3f}x theory, "
              f"{(max(peaks.values()) - peaks['base']) / theory:.2f}x above the base")


if __name__ == "__main__":
    main()
