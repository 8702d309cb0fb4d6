"""`mseq export hf CKPT OUT`: our checkpoint -> a Hugging Face `OPTForCausalLM` folder.

    mseq export hf checkpoints out/opt --dtype fp16
    python -c "from transformers import OPTForCausalLM; OPTForCausalLM.from_pretrained('out/opt')"

CKPT is a save dir (its `checkpoint_last`) or a `checkpoint_*` dir, saved by any number of
ranks with any ZeRO stage and tensor-parallel degree (shards are merged by the partition
metadata the checkpoint records). OUT gets `config.json`, `generation_config.json`, the
weights as `model.safetensors` (or shards + `model.safetensors.index.json` above
`--max-shard-size`) and the run's tokenizer (`AutoTokenizer.from_pretrained(OUT)` loads it:
GPT-2 BPE, a tokenizer.json, or the byte tokenizer as an equivalent byte-level one). Weights stream
tensor by tensor from memory-mapped files, so the export never holds two copies of the model.
"""

import contextlib
import io
from pathlib import Path
from typing import Any, Dict, List

from metaseq_ds.errors import UsageError

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def export_hf(checkpoint: str, out: str, dtype: str = "fp32", max_shard_size: str = "5GB") -> List[str]:
    """Write the HF folder; returns notes for the user (what was left out and why)."""
    import torch
    from transformers import GenerationConfig

    from metaseq_ds.checkpoint import files
    from metaseq_ds.checkpoint.safetensors_io import parse_size, write_model
    from metaseq_ds.checkpoint.staged_output import check_free, staged_output
    from metaseq_ds.models.hf_opt import to_hf_config

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as error:
        raise UsageError(f"--max-shard-size: {error}") from None
    out_dir = Path(out)
    check_free(out_dir)
    ref = files.find_checkpoint(checkpoint)
    if ref is None:
        raise UsageError(f"CKPT {checkpoint} is not a checkpoint (expected a save dir with checkpoint_last, "
                         f"or a checkpoint_* dir with {files.META})")
    meta = ref.meta()
    model_cfg = saved_model_config(meta, ref.path)
    weights = _read_lazily(ref)
    torch_dtype = getattr(torch, DTYPES[dtype])
    hf_config = to_hf_config(model_cfg, vocab_size=weights["decoder.embed_tokens.weight"].shape[0])
    hf_config.architectures = ["OPTForCausalLM"]
    hf_config.dtype = torch_dtype
    tensors = pending_hf_tensors(weights, model_cfg, torch_dtype, ref.path)
    with staged_output(out_dir) as staging:
        hf_config.save_pretrained(staging)
        GenerationConfig.from_model_config(hf_config).save_pretrained(staging)
        write_model(staging, tensors, max_bytes)
        notes = export_tokenizer(meta["config"].get("task", {}), staging, hf_config.max_position_embeddings)
    return notes


def saved_model_config(meta: Dict[str, Any], where: Path):
    """The checkpoint's `transformer_lm` config; any other model has no OPT equivalent."""
    from metaseq_ds.dataclass import validate_config
    from metaseq_ds.models.transformer_lm import TransformerLanguageModelConfig

    model = dict(meta["config"]["model"])
    name = model.pop("_name", None)
    if name != "transformer_lm":
        raise UsageError(f"{where}: model {name!r} (--arch {meta['config'].get('arch')}) has no Hugging Face OPT "
                         f"equivalent; export knows transformer_lm and its architectures")
    return validate_config(TransformerLanguageModelConfig, model)


def _read_lazily(ref) -> Dict[str, Any]:
    from metaseq_ds.checkpoint.read import lazy_model_weights

    try:
        # DeepSpeed's consolidation prints progress meant for its own script; ours stays quiet.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return lazy_model_weights(ref)
    except Exception as error:  # torch/DeepSpeed raise many types for a damaged file
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise UsageError(f"{ref.path}: cannot read the weights (truncated or damaged file?): {first}") from None


def pending_hf_tensors(weights: Dict[str, Any], model_cfg, torch_dtype, where: Path):
    """One `PendingTensor` per HF key, in our order; each converts its tensor when written."""
    from metaseq_ds.checkpoint.safetensors_io import PendingTensor
    from metaseq_ds.models.hf_opt import key_map
    from metaseq_ds.models.transformer_decoder import embed_scale

    keys = key_map(model_cfg.decoder_layers)
    unknown = sorted(set(weights) - set(keys))
    if unknown:
        raise UsageError(f"{where}: weight {unknown[0]!r} has no Hugging Face OPT equivalent")
    scale = embed_scale(model_cfg)
    tensors = []
    for name, value in weights.items():
        if name == "decoder.output_projection.weight" and model_cfg.share_decoder_input_output_embed:
            continue  # OPTForCausalLM ties lm_head to the embeddings itself
        factor = scale if name == "decoder.embed_tokens.weight" else 1.0

        def produce(value=value, factor=factor):
            tensor = value.contiguous()
            if factor != 1.0:  # OPT has no embedding scale: fold ours into the (untied) table
                tensor = tensor.float() * factor
            return tensor.to(torch_dtype)

        tensors.append(PendingTensor(keys[name], tuple(value.shape), torch_dtype, produce))
    return tensors


def export_tokenizer(task_cfg: Dict[str, Any], folder: Path, max_length: int) -> List[str]:
    """The run's tokenizer as a `PreTrainedTokenizerFast` (OPT's special tokens, `max_length`
    positions); notes if its files are gone."""
    hf_tokenizer = task_cfg.get("hf_tokenizer")
    vocab, merges = task_cfg.get("vocab_filename"), task_cfg.get("merges_filename")
    missing = [p for p in (hf_tokenizer, vocab, merges) if p and not Path(p).is_file()]
    if missing:
        return [f"no tokenizer files written: the run's {missing[0]} is not there any more"]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if hf_tokenizer:
        backend = Tokenizer.from_file(hf_tokenizer)
    elif vocab or merges:  # what `tokenizers.ByteLevelBPETokenizer.from_file` (our training tokenizer) builds
        backend = Tokenizer(models.BPE.from_file(vocab, merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend = byte_tokenizer()
    # OPT's conventions: `</s>` ends (and, in OPT's own tokenizer, starts) documents. No clean-up
    # of spaces before punctuation when decoding (transformers 4's default): decode gives our text.
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="</s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_length, clean_up_tokenization_spaces=False,
    ).save_pretrained(folder)
    return []


def byte_tokenizer():
    """`data.tokenizers.ByteTokenizer` (id = 4 + UTF-8 byte) as a `tokenizers.Tokenizer`: the
    ByteLevel pre-tokenizer, without its regex or prefix space, maps each byte of the text to one
    character of GPT-2's byte alphabet, which a BPE without merges maps to its id; the ByteLevel
    decoder maps the characters back to bytes (undecodable ones, as ours, to U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from metaseq_ds.data.dictionary import SPECIAL_SYMBOLS
    from metaseq_ds.data.tokenizers import ByteTokenizer

    vocab = {symbol: index for index, symbol in enumerate(SPECIAL_SYMBOLS)}
    vocab.update({char: ByteTokenizer.offset + byte for byte, char in bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend
