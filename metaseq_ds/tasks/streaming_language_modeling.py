"""metaseq's `streaming_language_modeling` task: train a decoder LM on jsonl text.

    mseq train DATA --task streaming_language_modeling --tokens-per-sample 1024 \
        --vocab-filename gpt2-vocab.json --merges-filename gpt2-merges.txt

DATA has metaseq's layout (see `metaseq_ds.data.jsonl`); without DATA the task trains on the
demo corpus built from Python's standard library, with the byte tokenizer unless a tokenizer
is given. Each document becomes its tokens plus the end-of-document token, documents are
shuffled per epoch and cut into samples by `--sample-break-mode`, and the batch iterator
splits global micro-batches across ranks so that the data order never depends on the number
of ranks or on --update-freq (which metaseq refused with streaming data; here it just works).

Loading a split tokenizes each of its shards once into a token store (beside the data, or in
`--data-cache-dir`; `mseq preprocess` does it ahead of time): see `metaseq_ds.data.token_store`.
Samples are then read by index (`metaseq_ds.data.sample_index`): each rank reads only its rows,
a resumed run seeks to its batch, and a background thread (or DataLoader workers) prepares
the next batches while the step runs (`metaseq_ds.data.prefetch`).

Left out of metaseq's config: the multi-corpus sampling flags (`multicorpus_sampling_*`,
`data_sampling_prob`), `data_subshard_count`, and the CM3 objective; `max_source_positions` /
`max_target_positions` belong to the model (its `max_target_positions` defaults to
`--tokens-per-sample`).
"""

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import List, Literal, Optional

import numpy as np

from metaseq_ds.data import Dictionary, EpochBatchIterator, build_demo_corpus, build_tokenizer, collate_blocks
from metaseq_ds.data.iterators import RankBatches
from metaseq_ds.data.jsonl import check_data_dir, shard_dirs
from metaseq_ds.data.prefetch import background_batches
from metaseq_ds.data.sample_index import IndexedSamples
from metaseq_ds.data.store_builder import default_workers
from metaseq_ds.data.token_store import TokenStore, open_store, store_root
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import PositiveInt, Seed
from metaseq_ds.errors import UsageError
from metaseq_ds.tasks.base_task import LegacyTask
from metaseq_ds.tasks.registry import register_task

logger = logging.getLogger(__name__)

DEFAULT_DATA_BUFFER_SIZE = 10  # metaseq's --data-buffer-size default


@dataclass
class StreamingLanguageModelingConfig(MetaseqDataclass):
    data: Optional[str] = field(
        default=None,
        metadata={"help": "data directory: train/00/*.jsonl, valid/00/*.jsonl, ... (default: a demo corpus of Python's standard library)"},
    )
    hf_tokenizer: Optional[str] = field(
        default=None, metadata={"help": "a Hugging Face tokenizer.json (ids 0-3 must be <s> <pad> </s> <unk>)"}
    )
    vocab_filename: Optional[str] = field(default=None, metadata={"help": "GPT-2 byte BPE vocab.json (with --merges-filename)"})
    merges_filename: Optional[str] = field(default=None, metadata={"help": "GPT-2 byte BPE merges.txt (with --vocab-filename)"})
    end_of_document_symbol: str = field(default="</s>", metadata={"help": "token appended to every document"})
    sample_break_mode: Literal["none", "complete", "eos_pad_8", "passthrough"] = field(
        default="none",
        metadata={
            "help": "none: concatenate documents and cut into blocks; complete: pack whole documents, pad; "
            "eos_pad_8: one document per sample, padded to a multiple of 8; passthrough: one document per sample, truncated"
        },
    )
    tokens_per_sample: PositiveInt = field(default=1024, metadata={"help": "sequence length: tokens the model sees per sample"})
    final_vocab_size: Optional[PositiveInt] = field(
        default=None, metadata={"help": "pad the dictionary to this size (default: to a multiple of --padding-factor)"}
    )
    padding_factor: PositiveInt = field(
        default=8,
        metadata={"help": "pad the dictionary to a multiple of this; --model-parallel-size N makes it 8*N, as metaseq did"},
    )
    seed: Seed = field(default=1, metadata={"help": "same as --seed: the data order depends on it"})
    batch_size: PositiveInt = field(default=8, metadata={"help": "same as --batch-size"})
    batch_size_valid: Optional[PositiveInt] = field(default=None, metadata={"help": "same as --batch-size-valid"})
    data_cache_dir: Optional[str] = field(
        default=None,
        metadata={"help": "where the token stores (each shard tokenized once, memory-mapped) are kept "
                  "(default: DATA/.token_store, beside the data; use this if DATA is read-only)"},
    )


@register_task("streaming_language_modeling", dataclass=StreamingLanguageModelingConfig)
class StreamingLanguageModelingTask(LegacyTask):
    """Language modeling on a stream of jsonl documents; `args` is a StreamingLanguageModelingConfig."""

    def __init__(self, args: StreamingLanguageModelingConfig):
        super().__init__(args)
        self.tokenizer = build_tokenizer(args.hf_tokenizer, args.vocab_filename, args.merges_filename)
        self.eod = self.tokenizer.token_to_id(args.end_of_document_symbol)
        if self.eod is None:
            raise UsageError(f"--end-of-document-symbol {args.end_of_document_symbol!r} is not in the tokenizer's vocabulary")
        self.dictionary = self._build_dictionary(args.final_vocab_size, args.padding_factor)
        self._data_dir = check_data_dir(Path(args.data)) if args.data else None

    @property
    def data_dir(self) -> Path:
        """DATA; a task built without one (by a script) reads the demo corpus, built on first use
        (generation never reads data, so it builds nothing)."""
        if self._data_dir is None:
            self._data_dir = build_demo_corpus()
            logger.info("no DATA given: reading the demo corpus at %s", self._data_dir)
        return self._data_dir

    def _build_dictionary(self, final_vocab_size: Optional[int], padding_factor: int) -> Dictionary:
        """The tokenizer's ids as a Dictionary, padded like metaseq's (50265 -> 50272 for GPT-2)."""
        size = self.tokenizer.vocab_size
        # A hole in a tokenizer's ids must still take its place, or every later id would shift.
        dictionary = Dictionary(self.tokenizer.id_to_token(i) or f"<unused{i}>" for i in range(Dictionary().nspecial, size))
        if final_vocab_size is None:
            dictionary.pad_to_multiple_(padding_factor)
        elif final_vocab_size < size:
            raise UsageError(f"--final-vocab-size {final_vocab_size} is smaller than the tokenizer's vocabulary ({size})")
        else:
            dictionary.pad_to_multiple_(final_vocab_size)
        return dictionary

    def tokenize(self, text: str) -> np.ndarray:
        """A document's tokens: its rstripped text, then the end-of-document token."""
        return np.array(self.tokenizer.encode(text.rstrip()) + [self.eod], dtype=np.int64)

    def load_dataset(self, split: str, epoch: int = 1, **kwargs) -> None:
        """Open `split` ("train", "valid", "valid/<name>"): the token stores of all its shards,
        built now where missing, so that a bad line fails before training starts and no later
        epoch waits for tokenization."""
        training = split == "train"
        self.datasets[split] = IndexedSamples(
            self.token_stores(split),
            block_size=self.args.tokens_per_sample + 1,  # +1: the last input token needs a target
            break_mode=self.args.sample_break_mode,
            shuffle=training,
            drop_last=training,
        )

    def token_stores(self, split: str, workers: Optional[int] = None) -> List[TokenStore]:
        """One token store per shard of `split`, in shard order (see `token_store`)."""
        return [self.token_store(split, shard, workers) for shard in shard_dirs(self.data_dir, split)]

    def token_store(self, split: str, shard: Path, workers: Optional[int] = None, progress=None) -> TokenStore:
        """The token store of one shard directory of `split`, built if missing by `workers`
        processes (default: this machine's CPUs), which report jsonl bytes done to `progress`."""
        root = store_root(self.data_dir, self.args.data_cache_dir)
        return open_store(root, split, shard, self.tokenizer, self.eod, workers or default_workers(), progress)

    def get_batch_iterator(
        self,
        split: str,
        batch_size: Optional[int] = None,
        seed: Optional[int] = None,
        num_shards: int = 1,
        shard_id: int = 0,
        epoch: int = 1,
        num_workers: int = 0,
        data_buffer_size: int = DEFAULT_DATA_BUFFER_SIZE,
    ) -> EpochBatchIterator:
        """This rank's micro-batches of `split` (loaded on first use), from `epoch` on.

        batch_size: rows per rank (default --batch-size; --batch-size-valid for other splits);
        seed: the data-order seed (default --seed). See `metaseq_ds.data.iterators`.
        num_workers, data_buffer_size: how batches are prepared ahead (metaseq's flags; see
        `metaseq_ds.data.prefetch`): 0 workers is a background thread, 0 buffer none.
        """
        if split not in self.datasets:
            self.load_dataset(split, epoch=epoch)
        dataset = self.datasets[split]
        training = split == "train"
        if batch_size is None:
            batch_size = self.args.batch_size if training else (self.args.batch_size_valid or self.args.batch_size)
        seed = self.args.seed if seed is None else seed
        collate = partial(
            collate_blocks, pad=self.dictionary.pad(), tokens_per_sample=self.args.tokens_per_sample, break_mode=self.args.sample_break_mode
        )

        def batches_for_epoch(epoch: int, skip: int):
            def rank_batches() -> RankBatches:
                return RankBatches(dataset.epoch(epoch, seed), batch_size, num_shards, shard_id, fill_last=not training,
                                   collate=collate, first=skip, what=f"split {split!r} (epoch {epoch})")

            return background_batches(rank_batches, num_workers, data_buffer_size)

        return EpochBatchIterator(batches_for_epoch, epoch=epoch)

    def max_positions(self) -> int:
        return self.args.tokens_per_sample

    def build_bpe(self, args=None):
        """The tokenizer this task's flags chose (`args`, metaseq's `cfg.bpe`, chooses nothing here)."""
        return self.tokenizer

    @property
    def source_dictionary(self) -> Dictionary:
        return self.dictionary

    @property
    def target_dictionary(self) -> Dictionary:
        return self.dictionary
