"""Where a metaseq_ds (or Hugging Face) training step spends its time: torch.profiler, summarised.

    python -m benchmarks.profile_train [--dtype bf16] [--side ours] [--steps 2] [--top 25] [--compile-layers]
    python -m benchmarks.profile_train --layers 24 --dim 2048 --heads 32 --ffn 8192 --seq 2048 --batch 8  # on CUDA

One process, the configuration of `benchmarks/train.py` (same flags, same DeepSpeed config),
after one warm-up step, `--steps` steps profiled. On CUDA (used whenever there is one) it prints
the top kernels by GPU time, then the step split into matmul kernels, attention kernels, other
kernels and the GPU's idle time between kernels (the host gaps: launch overhead, syncs, Python);
on the CPU the top ops by self CPU time and the same split of the ops' self time.

    python -m benchmarks.profile_train --structure --layers 24 --dim 2048 --heads 32 --ffn 8192 --seq 2048 --batch 8

`--structure`: what a GPU would run for one forward and backward, counted without one, with the
reads of the device it makes (each a host sync on a GPU). Both sides
(ours and HF's OPT) run on the meta device (nothing computed, any size; the code's non-CPU paths).
Attention is taken as a flash kernel, as CUDA picks it; on meta, SDPA would otherwise fall back to
its math path. For each side it counts the kernels (every aten op but views and allocations) and
the bytes each op reads and writes. Those bytes are an upper bound for scatters and in-place ops,
which are counted as reading and writing their whole input. The bytes outside matmul and attention
are what bound the elementwise kernels' time on a GPU (at ~4 TB/s on an H200, 4 GB is 1 ms).
"""

import argparse
import re
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.train import NAMES
from benchmarks.train_worker import SIDES, add_run_arguments, batches, step_fn, train_flags

# Kernel and op names by what they compute (cuBLAS/CUTLASS gemms, cuBLAS's Hopper `nvjet_*`
# gemms among them, flash/memory-efficient attention; on the CPU aten's product ops and oneDNN's linear).
MATMUL = re.compile(r"gemm|cutlass|xmma|sm\d+_|wgmma|cublas|nvjet|aten::(mm|addmm|bmm|matmul|linear|_addmm)_?\b|mkldnn|onednn",
                    re.IGNORECASE)
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|(?<!log)_softmax_backward_data", re.IGNORECASE)  # not the loss's


def kind(name: str) -> str:
    if ATTENTION.search(name):
        return "attention"
    return "matmul" if MATMUL.search(name) else "other"


def split_by_kind(times: Dict[str, float]) -> Dict[str, float]:
    """Summed time per kind of the {name: time} given."""
    kinds: Dict[str, float] = defaultdict(float)
    for name, value in times.items():
        kinds[kind(name)] += value
    return kinds


def kernel_intervals(prof) -> List[Tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and memory copy/set, in start order."""
    spans = [(event.time_range.start, event.time_range.end, event.name) for event in prof.events()
             if event.device_type == DeviceType.CUDA]
    return sorted(spans)


def gpu_summary(prof, wall_seconds: float, steps: int, top: int) -> None:
    spans = kernel_intervals(prof)
    per_name: Dict[str, float] = defaultdict(float)
    for start, end, name in spans:
        per_name[name] += end - start
    busy, idle, gaps, last_end = 0.0, 0.0, 0, None
    for start, end, _ in spans:  # kernels of one stream run in order; overlaps count once
        if last_end is not None and start > last_end:
            idle += start - last_end
            gaps += start - last_end > 10.0
        busy += max(0.0, end - max(start, last_end or start))
        last_end = end if last_end is None else max(last_end, end)
    print(f"top {top} kernels by GPU time ({steps} steps):")
    for name, micros in sorted(per_name.items(), key=lambda item: -item[1])[:top]:
        print(f"  {micros / 1e3 / steps:9.2f} ms/step  {kind(name):9s}  {name[:100]}")
    kinds = split_by_kind(per_name)
    step_ms = wall_seconds * 1e3 / steps
    print(f"per step: wall {step_ms:.1f} ms; GPU busy {busy / 1e3 / steps:.1f} ms, idle between kernels "
          f"{idle / 1e3 / steps:.1f} ms ({gaps / steps:.0f} gaps over 10 us)")
    for name in ("matmul", "attention", "other"):
        print(f"  {name:9s} kernels {kinds[name] / 1e3 / steps:9.1f} ms/step ({kinds[name] / 1e3 / steps / step_ms:.0%} of the wall)")
    print(f"summary: {step_ms:.1f} ms a step: " + ", ".join(
        f"{name} {kinds[name] / 1e3 / steps:.1f} ms ({kinds[name] / 1e3 / steps / step_ms:.0%})" for name in ("matmul", "attention", "other"))
        + f", GPU idle between kernels {idle / 1e3 / steps:.1f} ms ({idle / 1e3 / steps / step_ms:.0%}, {gaps / steps:.0f} gaps over 10 us)")


def cpu_summary(prof, wall_seconds: float, steps: int, top: int) -> None:
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    self_times = {average.key: average.self_cpu_time_total for average in prof.key_averages()}
    kinds = split_by_kind(self_times)
    step_ms = wall_seconds * 1e3 / steps
    print(f"per step: wall {step_ms:.1f} ms")
    for name in ("matmul", "attention", "other"):
        print(f"  {name:9s} ops {kinds[name] / 1e3 / steps:9.1f} ms/step self time ({kinds[name] / 1e3 / steps / step_ms:.0%} of the wall)")
    print(f"summary: {step_ms:.1f} ms a step: " + ", ".join(
        f"{name} ops {kinds[name] / 1e3 / steps:.1f} ms ({kinds[name] / 1e3 / steps / step_ms:.0%})" for name in ("matmul", "attention", "other")))


class _OpBytes(TorchDispatchMode):
    """Each aten op that runs a kernel: how many times, and the bytes of its tensor inputs and outputs."""

    # Allocations, and the one view the schema does not mark as one: no kernel (views are skipped by `is_view`).
    FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.calls: Dict[str, int] = defaultdict(int)
        self.bytes: Dict[str, int] = defaultdict(int)
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and args[0].is_meta:
            # A read of the device (a host sync on a GPU), which meta cannot answer: counted, and
            # answered as for these batches (no padding: HF's masks hold only ones).
            self.reads += 1
            return True if args[0].dtype == torch.bool else 1
        out = func(*args, **(kwargs or {}))
        if func.is_view or name in self.FREE:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.calls[name] += 1
        self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Structure only: CUDA's flash kernel (both sides' masks are causal at this benchmark's
    unpadded batches) where the meta device would take SDPA's math path."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, False, scale=scale)[0]


def step_structure(side: str, cfg, args) -> _OpBytes:
    """One forward and backward of `side`'s model on the meta device, its ops counted."""
    from benchmarks.train_worker import VOCAB, RandomTokensTask

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tokens = torch.randint(4, VOCAB, (args.batch, args.seq + 1), device="meta")
    counted = _OpBytes()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_attention
    try:
        if side == "ours":
            from metaseq_ds import criterions
            from metaseq_ds.distributed.parallelize import parallelize

            task = RandomTokensTask(cfg.task)
            criterion = criterions.build_criterion(cfg.criterion, task)
            with torch.device("meta"):
                model = task.build_model(cfg.model)
            model = parallelize(model, cfg, criterion).to(dtype).train()
            sample = {"net_input": {"src_tokens": tokens[:, :-1], "left_padded": False}, "target": tokens[:, 1:],
                      "ntokens": tokens[:, 1:].numel(), "nsentences": args.batch}
            with counted:
                criterion(model, sample)[0].backward()
        else:
            from transformers import OPTForCausalLM

            from metaseq_ds.models.hf_opt import to_hf_config

            with torch.device("meta"):
                model = OPTForCausalLM._from_config(to_hf_config(cfg.model, vocab_size=VOCAB), attn_implementation="sdpa")
            model = model.to(dtype).train()
            with counted:
                model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss.backward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return counted


def structure_summary(cfg, args) -> None:
    print(f"one forward and backward on the meta device, {args.dtype}, {args.batch} x {args.seq} tokens, "
          f"d {args.dim}, {args.layers} layers, FFN {args.ffn} (GB read + written; scatters and in-place ops "
          f"counted whole)")
    for side in ("ours", "hf"):
        counted = step_structure(side, cfg, args)
        by_kind = {name: kind(f"aten::{name}") for name in counted.calls}
        other = {name: counted.bytes[name] for name, found in by_kind.items() if found == "other"}
        print(f"{NAMES[side]}: {sum(counted.calls.values())} kernels, "
              f"{sum(counted.calls[name] for name in other)} outside matmul/attention moving "
              f"{sum(other.values()) / 1e9:.1f} GB; matmul/attention {sum(counted.bytes.values()) / 1e9 - sum(other.values()) / 1e9:.1f} GB; "
              f"device reads (host syncs on a GPU): {counted.reads}")
        for name, moved in sorted(other.items(), key=lambda item: -item[1])[:args.top]:
            print(f"  {moved / 1e9:8.2f} GB  {counted.calls[name]:5d} x  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, default="ours")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--structure", action="store_true", help="kernels and bytes moved of both sides on the "
                                                                  "meta device (see above), instead of a profile")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.structure:
        from metaseq_ds.options import parse_train_config

        structure_summary(parse_train_config(train_flags(args)), args)
        return

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.options import parse_train_config

    dist_utils.init_distributed()
    args.world_size = 1
    cfg = parse_train_config(train_flags(args))
    torch.manual_seed(cfg.common.seed)
    ds_config = build_deepspeed_config(cfg, args.world_size, **accelerator_traits())
    step, engine = step_fn(args.side, cfg, args, ds_config)
    cuda = engine.device.type == "cuda"
    data = batches(args, 1 + args.steps)
    step(next(data))  # warm-up (and compilation, with --compile-layers)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for tokens in data:
            step(tokens)  # each step ends reading its loss: the device is done with it
        wall = time.perf_counter() - start
    print(f"{args.side}, {args.dtype}, {engine.device.type}, ZeRO-{engine.zero_optimization_stage()}, "
          f"{args.batch} x {args.seq} tokens a step, d {args.dim}, {args.layers} layers"
          f"{', layers compiled' if args.compile_layers or args.side == 'hf_compiled' else ''}")
    (gpu_summary if cuda else cpu_summary)(prof, wall, args.steps, args.top)


if __name__ == "__main__":
    main()
