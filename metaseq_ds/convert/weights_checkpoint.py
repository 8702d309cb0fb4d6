"""Write imported weights as a checkpoint of ours: weights only, no optimizer or data position.

    OUT/checkpoint_last                       -> checkpoint_0_0
    OUT/checkpoint_0_0/mp_rank_00_model_states.pt   {"module": state_dict}, DeepSpeed's file name
    OUT/checkpoint_0_0/metaseq_ds.json        config (arch transformer_lm, explicit sizes),
                                              "weights_only": true, "imported_from"
    OUT/tokenizer/...                         the source's tokenizer files, when it had them

`mseq validate --path OUT` and `mseq generate --path OUT` read it like any ZeRO-0 checkpoint;
`mseq train --restore-file OUT` starts from its weights with a fresh optimizer at update 0.
"""

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional

import torch

from metaseq_ds.errors import UsageError

TAG = "checkpoint_0_0"


def run_config(model_fields: Mapping[str, Any], tokenizer: Mapping[str, str], vocab_size: int):
    """A full `MetaseqConfig` for the imported model: what `--arch transformer_lm` with these
    model fields and tokenizer files gives (no data directory: the weights came without one)."""
    from metaseq_ds.options import config_from_values

    values = {**model_fields, **tokenizer, "tokens_per_sample": model_fields["max_target_positions"],
              "final_vocab_size": vocab_size}
    return config_from_values({name: value for name, value in values.items() if value is not None})


def check_tokenizer_fits(tokenizer: Mapping[str, str], vocab_size: int, source: str) -> None:
    from metaseq_ds.data.tokenizers import build_tokenizer

    built = build_tokenizer(tokenizer.get("hf_tokenizer"), tokenizer.get("vocab_filename"), tokenizer.get("merges_filename"))
    if built.vocab_size > vocab_size:
        what = "the byte tokenizer's" if not tokenizer else "its tokenizer's"
        raise UsageError(f"{source}: the model's vocabulary ({vocab_size} rows) is smaller than {what} "
                         f"({built.vocab_size}); give the tokenizer files the model was trained with")


def check_state_dict(cfg, state_dict: Mapping[str, torch.Tensor], vocab_size: int, source: str) -> None:
    """Every key and shape of the model the config describes (built on the meta device: no memory)."""
    from metaseq_ds.data import Dictionary
    from metaseq_ds.models.transformer_lm import TransformerLanguageModel

    task = SimpleNamespace(dictionary=Dictionary.of_size(vocab_size))
    with torch.device("meta"):
        expected = TransformerLanguageModel.build_model(cfg.model, task).state_dict()
    for name, tensor in expected.items():
        if name not in state_dict:
            raise UsageError(f"{source}: weight {name!r} is missing")
        if tuple(state_dict[name].shape) != tuple(tensor.shape):
            raise UsageError(f"{source}: {name} has shape {tuple(state_dict[name].shape)}, "
                             f"the config implies {tuple(tensor.shape)}")
    extra = sorted(set(state_dict) - set(expected))
    if extra:
        raise UsageError(f"{source}: weight {extra[0]!r} has no place in a transformer_lm")


def write_weights_only_checkpoint(
    out: Path, state_dict: Dict[str, torch.Tensor], model_fields: Dict[str, Any],
    tokenizer_files: Dict[str, Path], source: str,
) -> List[str]:
    """Check, then write atomically (see `checkpoint.staged_output`); returns notes for the user."""
    from metaseq_ds.checkpoint.files import write_module_checkpoint
    from metaseq_ds.checkpoint.staged_output import check_free, staged_output

    check_free(out)
    vocab_size = state_dict["decoder.embed_tokens.weight"].shape[0]
    final_dir = out.resolve() / "tokenizer"
    tokenizer = {field: str(final_dir / path.name) for field, path in tokenizer_files.items()}
    check_tokenizer_fits({field: str(path) for field, path in tokenizer_files.items()}, vocab_size, source)
    cfg = run_config(model_fields, tokenizer, vocab_size)
    converted: Dict[int, torch.Tensor] = {}  # by identity: a tied weight stays one tensor
    state_dict = {name: converted.setdefault(id(t), t.contiguous().float()) for name, t in state_dict.items()}
    check_state_dict(cfg, state_dict, vocab_size, source)
    notes = [] if tokenizer_files else [
        f"{source} has no tokenizer files: the checkpoint uses the byte tokenizer; for text in and out, "
        "pass the model's tokenizer to mseq (--vocab-filename/--merges-filename or --hf-tokenizer)"]
    with staged_output(out) as staging:
        if tokenizer_files:
            (staging / "tokenizer").mkdir()
            for path in tokenizer_files.values():
                shutil.copyfile(path, staging / "tokenizer" / path.name)
        write_module_checkpoint(staging, TAG, state_dict,
                                {"config": cfg.to_dict(), "weights_only": True, "imported_from": source})
    return notes


def model_fields_or_error(values: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Validate model fields through the config dataclass (its checks, one-line errors)."""
    from metaseq_ds.dataclass import validate_config
    from metaseq_ds.models.transformer_lm import TransformerLanguageModelConfig

    try:
        validate_config(TransformerLanguageModelConfig, values)
    except UsageError as error:
        raise UsageError(f"{source}: {error}") from None
    return values


def optional_path(folder: Path, name: str) -> Optional[Path]:
    path = folder / name
    return path if path.is_file() else None
