"""`mseq preprocess DATA`: tokenize a corpus once into token stores, ahead of `mseq train`.

    mseq preprocess DATA --vocab-filename gpt2-vocab.json --merges-filename gpt2-merges.txt --workers 16

Builds the store of every shard of every split (train/00, train/01, ..., valid/00,
valid/<name>/00) that has none for this tokenizer yet, exactly as `mseq train` would on first
use (same task code, same keys), with a progress bar over the jsonl bytes, then prints a
table of what is stored where. A run given the same data, tokenizer flags and
`--data-cache-dir` starts without tokenizing.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from metaseq_ds.dataclass.constraints import PositiveInt


@dataclass(frozen=True)
class PreprocessOptions:
    """The numbers `mseq preprocess` takes, each range declared once (check, --help, error)."""

    workers: Optional[PositiveInt] = None  # None: this machine's CPUs


def main(data: str, workers: Optional[int], hf_tokenizer: Optional[str], vocab_filename: Optional[str],
         merges_filename: Optional[str], end_of_document_symbol: str, data_cache_dir: Optional[str]) -> None:
    from metaseq_ds.dataclass import validate_value

    if workers is not None:
        validate_value(PreprocessOptions, "workers", workers, "--workers")
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.table import Table

    from metaseq_ds.data.jsonl import check_data_dir, list_splits, shard_dirs, shard_files
    from metaseq_ds.data.token_store import store_root
    from metaseq_ds.dataclass import validate_config
    from metaseq_ds.errors import UsageError
    from metaseq_ds.tasks import setup_task
    from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig

    splits = list_splits(check_data_dir(Path(data)))
    if not splits:
        raise UsageError(f"DATA: {data} holds no split (expected {data}/train/00/*.jsonl, {data}/valid/00/*.jsonl, ...)")
    cfg = validate_config(StreamingLanguageModelingConfig, {
        "data": data, "hf_tokenizer": hf_tokenizer, "vocab_filename": vocab_filename, "merges_filename": merges_filename,
        "end_of_document_symbol": end_of_document_symbol, "data_cache_dir": data_cache_dir,
    })
    task = setup_task(cfg)
    shards = [(split, shard, sum(path.stat().st_size for path in shard_files(shard)))
              for split in splits for shard in shard_dirs(task.data_dir, split)]

    table = Table("split", "shard", "documents", "tokens", "jsonl MB", "store", title="token stores")
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("tokenizing", total=sum(size for _, _, size in shards))
        done = 0
        for split, shard, size in shards:
            progress.update(bar, description=f"{split}/{shard.name}")
            tokenized = []
            started = time.perf_counter()

            def advance(n: int) -> None:
                tokenized.append(n)
                progress.advance(bar, n)

            store = task.token_store(split, shard, workers, advance)
            done += size
            progress.update(bar, completed=done)  # a store that existed counts as done
            seconds = time.perf_counter() - started
            status = f"built in {seconds:.1f} s" if tokenized else "existed"
            table.add_row(split, shard.name, f"{len(store):,}", f"{store.meta['tokens']:,}", f"{size / 1e6:.1f}",
                          f"{status} ({store.meta['dtype']})")
    Console().print(table)
    root = store_root(task.data_dir, data_cache_dir)
    flags = f" --data-cache-dir {data_cache_dir}" if data_cache_dir else ""
    print(f"stores in {root}; `mseq train {data}{flags}` with the same tokenizer flags reads them")
