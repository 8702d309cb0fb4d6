"""New tokens per second of greedy generation: metaseq_ds's SequenceGenerator vs Hugging Face
`generate`, on the same random OPT-style weights, in one run (default: fp32 on the CPU).

    python benchmarks/generate.py [--layers 4 --dim 256 --heads 4] [--threads N] [--device cuda --dtype bf16]

Prompts of 32 tokens, 128 new tokens each (end-of-sequence held back, so both produce all
128), batch 1 and batch 8. Prints tokens/s for each side (median of 3 runs, the two sides
interleaved) and their ratio.
Target: metaseq_ds >= 2x Hugging Face at batch 1 and >= 1.2x at batch 8.
The default model (4 layers, width 256, OPT's 50272-token vocabulary) spends most of a step
reading its 51 MB vocabulary projection; pass OPT-125m's shape (`--layers 12 --dim 768
--heads 12`) to see steps dominated by the layers' weights; OPT-1.3b's (`--layers 24 --dim 2048
--heads 32`) on a GPU. Each row also gives the time of a decoding step and the share of the
memory-bandwidth limit it reaches: a step reads every weight once, so weight bytes / step time
against the copy bandwidth `benchmarks/peak.py` measures on the same device.
"""

import argparse
import statistics
import time

import torch

from benchmarks import peak
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


def interleaved_tokens_per_second(ours, theirs, batch: int, rounds: int = 3):
    """Median tokens/s of each side over `rounds` runs taken A, B, A, B, ... after one warm-up
    each (first-call allocations, kernel choices): load on a shared machine hits both alike.
    Each run is timed to the device's completion."""
    ours(), theirs()
    times = {ours: [], theirs: []}
    for _ in range(rounds):
        for fn in (ours, theirs):
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[fn].append(time.perf_counter() - start)
    return [batch * NEW / statistics.median(times[fn]) for fn in (ours, theirs)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf = build(args.layers, args.dim, args.heads, args.device, DTYPES[args.dtype])
    bandwidth = peak.copy_gbytes_per_s(0.5, 1024 if args.device == "cuda" else 256, args.device) * 1e9
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: {args.layers} layers, width {args.dim}, vocab 50272, {args.dtype}, {where}; "
          f"prompt {PROMPT}, {NEW} new tokens, greedy; weights {weight_bytes(ours) / 1e9:.2f} GB, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'batch':>5} {'metaseq_ds tok/s':>17} {'ms/step':>8} {'of bw limit':>11} {'HF tok/s':>9} {'ms/step':>8} {'ratio':>6}")
    targets = {1: 2.0, 8: 1.2}
    verdicts = []
    for batch in (1, 8):
        prompts = torch.randint(4, 50000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        generator = SequenceGenerator([ours], Task.dictionary, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0)

        def run_ours():
            hypos = generator.generate([ours], prompts.tolist())
            assert all(len(h[0]["tokens"]) == NEW for h in hypos)

        def run_hf():
            with torch.no_grad():
                ids = prompts.to(args.device)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=False, pad_token_id=1, eos_token_id=2)
            assert out.size(1) == PROMPT + NEW

        mine, theirs = interleaved_tokens_per_second(run_ours, run_hf, batch)
        ratio = mine / theirs
        step_ms = {side: 1000 * batch / rate for side, rate in (("ours", mine), ("hf", theirs))}
        share = weight_bytes(ours) / (step_ms["ours"] / 1000) / bandwidth
        verdicts.append(f"batch {batch}: {ratio:.2f}x ({'meets' if ratio >= targets[batch] else 'misses'} {targets[batch]}x), "
                        f"{mine:.1f} tok/s, {share:.1%} of the bandwidth limit")
        print(f"{batch:>5} {mine:>17.1f} {step_ms['ours']:>8.2f} {share:>11.1%} {theirs:>9.1f} {step_ms['hf']:>8.2f} "
              f"{ratio:>5.2f}x")
    print("summary: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
