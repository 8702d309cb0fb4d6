"""New tokens per second of greedy generation: metaseq_ds's SequenceGenerator (static KV cache
compiled and eager, and the incremental path) vs Hugging Face `generate` (its dynamic cache,
and its static cache), on the same random OPT-style weights, in one run (default: fp32, CPU).

    python -m benchmarks.generate [--layers 4 --dim 256 --heads 4] [--threads N] [--device cuda --dtype bf16]
                                  [--variants "static compiled,HF"]

Prompts of 32 tokens, 128 new tokens each (end-of-sequence held back, so all produce 128),
batch 1 and batch 8. Prints tokens/s of each variant (median of 3 runs, the variants taken in
turn after a warm-up that includes compiling), the time of a step, and the share of the
memory-bandwidth limit it reaches: a step reads every weight once, so weight bytes / step time
against the copy bandwidth `benchmarks/peak.py` measures on the same device. The summary
compares what `mseq generate` runs by default on the device with the faster HF variant.
Targets: >= 2x Hugging Face at batch 1 and >= 1.2x at batch 8 (the CPU); on an H200 at OPT-1.3b's
shape in bf16 (`--layers 24 --dim 2048 --heads 32`), >= 800 tokens/s at batch 1.
The default model (4 layers, width 256, OPT's 50272-token vocabulary) spends most of a step
reading its 51 MB vocabulary projection; OPT-125m's shape (`--layers 12 --dim 768 --heads 12`)
has steps dominated by the layers' weights.
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from benchmarks import peak
from metaseq_ds import static_decoding
from metaseq_ds.data import Dictionary
from metaseq_ds.models import TransformerLanguageModel, TransformerLanguageModelConfig
from metaseq_ds.models.hf_opt import state_dict_to_hf, to_hf_config
from metaseq_ds.sequence_generator import SequenceGenerator

PROMPT, NEW = 32, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Task:
    dictionary = Dictionary.of_size(50272)  # OPT's vocabulary size


def build(layers: int, dim: int, heads: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import OPTForCausalLM

    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=dim, decoder_ffn_embed_dim=4 * dim, decoder_layers=layers, decoder_attention_heads=heads,
        decoder_learned_pos=True, decoder_normalize_before=True, share_decoder_input_output_embed=True,
        no_scale_embedding=True, max_target_positions=2048, dropout=0.0,
    )
    torch.manual_seed(0)
    ours = TransformerLanguageModel.build_model(cfg, Task()).eval().to(device, dtype)
    with torch.device(device):  # Hugging Face draws its own initial values first: on the device, fast
        hf = OPTForCausalLM(to_hf_config(cfg, vocab_size=len(Task.dictionary))).eval().to(dtype)
    hf.load_state_dict(state_dict_to_hf(ours.state_dict(), layers))
    # What GeneratorInterface (and so `mseq generate`) does to the model it loads, as fairseq's
    # hub did: same weights, laid out for decoding (on the CPU; a GPU's are left as they are).
    ours.make_generation_fast_()
    return ours, hf


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decoding step reads: every parameter once (a tied one once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def interleaved_tokens_per_second(runs: Dict[str, Callable[[], None]], batch: int, rounds: int = 3) -> Dict[str, float]:
    """Median tokens/s of each run over `rounds` rounds taken in turn (A, B, C, A, B, C, ...)
    after one warm-up each (compiling, first-call allocations, kernel choices): load on a
    shared machine hits all alike. Each run is timed to the device's completion."""
    for run in runs.values():
        run()
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: batch * NEW / statistics.median(spent) for name, spent in times.items()}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def our_run(model, prompts: torch.Tensor, **path) -> Callable[[], None]:
    generator = SequenceGenerator([model], Task.dictionary, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0,
                                  **path)

    def run():
        hypos = generator.generate([model], prompts.tolist())
        assert all(len(h[0]["tokens"]) == NEW for h in hypos)

    return run


def hf_run(hf, prompts: torch.Tensor, device: str, **generate_kwargs) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            ids = prompts.to(device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=1, eos_token_id=2, **generate_kwargs)
        assert out.size(1) == PROMPT + NEW

    return run


# What each column runs; "ours" is what `mseq generate` does by default on the device.
OURS = "static compiled"
VARIANTS = {
    OURS: lambda ours, hf, prompts, device: our_run(ours, prompts, compile=True),
    "static eager": lambda ours, hf, prompts, device: our_run(ours, prompts, compile=False),
    "incremental eager": lambda ours, hf, prompts, device: our_run(ours, prompts, static_cache=False),
    "HF": lambda ours, hf, prompts, device: hf_run(hf, prompts, device),
    "HF static": lambda ours, hf, prompts, device: hf_run(hf, prompts, device, cache_implementation="static"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    ours, hf = build(args.layers, args.dim, args.heads, args.device, DTYPES[args.dtype])
    default = OURS if static_decoding.should_compile(None, torch.device(args.device)) else "static eager"
    bandwidth = peak.copy_gbytes_per_s(0.5, 1024 if args.device == "cuda" else 256, args.device) * 1e9
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: {args.layers} layers, width {args.dim}, vocab 50272, {args.dtype}, {where}; "
          f"prompt {PROMPT}, {NEW} new tokens, greedy; weights {weight_bytes(ours) / 1e9:.2f} GB, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; mseq generate's default here: {default}")
    print(f"{'batch':>5} {'variant':<24} {'tok/s':>9} {'ms/step':>8} {'of bw limit':>11}")
    targets = {1: 2.0, 8: 1.2}
    verdicts = []
    for batch in (1, 8):
        prompts = torch.randint(4, 50000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        runs = {name: VARIANTS[name](ours, hf, prompts, args.device) for name in chosen}
        rates = interleaved_tokens_per_second(runs, batch)
        for name, rate in rates.items():
            step_s = batch / rate
            share = weight_bytes(ours) / step_s / bandwidth
            print(f"{batch:>5} {name:<24} {rate:>9.1f} {1000 * step_s:>8.2f} {share:>11.1%}")
        hf_best = max((rate for name, rate in rates.items() if name.startswith("HF")), default=None)
        if default in rates and hf_best:
            ratio = rates[default] / hf_best
            verdicts.append(f"batch {batch}: {default} {rates[default]:.1f} tok/s, {ratio:.2f}x the faster HF "
                            f"({'meets' if ratio >= targets[batch] else 'misses'} {targets[batch]}x)")
    print("summary: " + ("; ".join(verdicts) or f"no ratio: the variants chosen leave out mseq generate's default "
                                                    f"here ({default}) or every HF one"))


if __name__ == "__main__":
    main()
