"""The token store and the indexed sample stream: same samples as the definition, each rank
reads only its rows, resume is a seek, stores are keyed, atomic, locked, built in parallel."""

import json
import logging
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import metaseq_ds.data.store_builder as store_builder
from data_fixtures import document, make_task, train_bpe, write_jsonl
from metaseq_ds.data import DocumentToSequenceDataset, JsonlSplit
from metaseq_ds.data.iterators import RankBatches, collated_batches, rank_rows
from metaseq_ds.data.prefetch import background_batches
from metaseq_ds.data.sample_index import EpochSamples, IndexedSamples
from metaseq_ds.data.token_store import STORE_DIR_NAME, StoreRequest, TokenStore, open_store, store_root
from metaseq_ds.errors import UsageError

TOKENS_PER_SAMPLE = 8
BLOCK = TOKENS_PER_SAMPLE + 1
MODES = ["none", "complete", "eos_pad_8", "passthrough"]


def texts(count, seed):
    """Documents whose byte-token lengths (text + end of document) hit every case of the break
    modes: 1 token (empty text), B - 1, B, B + 1, B + 2, several blocks, and short ones."""
    rng = random.Random(seed)
    special = [0, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 3 * BLOCK + 1, 3 * BLOCK + 2]
    lengths = special + [rng.choice([rng.randint(1, BLOCK), rng.randint(1, 4 * BLOCK)]) for _ in range(count - len(special))]
    rng.shuffle(lengths)
    return ["".join(rng.choice("abcdefgh") for _ in range(n - 1)) for n in lengths]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("store_corpus")
    write_jsonl(root / "train" / "00" / "a.jsonl", texts(60, 1))
    write_jsonl(root / "train" / "00" / "b.jsonl", texts(37, 2))
    write_jsonl(root / "train" / "01" / "a.jsonl", texts(45, 3))
    write_jsonl(root / "valid" / "00" / "a.jsonl", texts(23, 4))
    return root


def task_for(data, **values):
    return make_task(data, tokens_per_sample=TOKENS_PER_SAMPLE, **values)


def reference(task, split, mode, shuffle, drop_last):
    """The stream as `document_blocks` defines it: documents read and tokenized front to back."""
    return DocumentToSequenceDataset(JsonlSplit(task.data_dir, split).documents, task.tokenize, BLOCK, mode, shuffle, drop_last)


def as_lists(blocks):
    return [block.tolist() for block in blocks]


# ---- the indexed stream is the defined stream -----------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in_order"])
def test_indexed_samples_equal_the_defined_stream(corpus, mode, shuffle):
    task = task_for(corpus, sample_break_mode=mode)
    for drop_last in (True, False):
        indexed = IndexedSamples(task.token_stores("train"), BLOCK, mode, shuffle, drop_last)
        defined = reference(task, "train", mode, shuffle, drop_last)
        for seed in (1, 7, 2**32 + 7):
            for epoch in (1, 2, 3):  # shards 00, 01, 00 again
                samples = indexed.epoch(epoch, seed)
                expected = as_lists(defined.samples(epoch, seed))
                assert as_lists(samples[i] for i in range(len(samples))) == expected, (seed, epoch, drop_last)
                assert len(expected) > 10


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_split_gives_the_rows_of_the_defined_split(corpus, mode):
    task = task_for(corpus, sample_break_mode=mode)
    collate = lambda rows: [(i, None if block is None else block.tolist()) for i, block in rows]  # noqa: E731
    for split, training in (("train", True), ("valid", False)):
        indexed = IndexedSamples(task.token_stores(split), BLOCK, mode, shuffle=training, drop_last=training)
        defined = reference(task, split, mode, shuffle=training, drop_last=training)
        for num_shards, batch_size in ((1, 1), (1, 5), (2, 3), (3, 2), (4, 1)):
            for shard_id in range(num_shards):
                for seed, epoch in ((1, 1), (3, 2)):
                    what = f"{split} {num_shards}x{batch_size} rank {shard_id}"
                    rows = rank_rows(defined.samples(epoch, seed), batch_size, num_shards, shard_id, fill_last=not training)
                    expected = list(collated_batches(rows, 0, collate, what))
                    batches = RankBatches(indexed.epoch(epoch, seed), batch_size, num_shards, shard_id, not training, collate, 0, what)
                    assert [batches[k] for k in range(len(batches))] == expected, what


def test_a_gpt2_bpe_store_holds_what_the_tokenizer_encodes(corpus, tmp_path):
    vocab, merges, _ = train_bpe(tmp_path / "bpe")
    task = task_for(corpus, vocab_filename=str(vocab), merges_filename=str(merges))
    store = task.token_stores("train")[1]
    assert store.tokens.dtype == np.uint16 and store.meta["vocab_size"] == task.tokenizer.vocab_size
    documents = JsonlSplit(corpus, "train").documents(2)
    assert [store.document(d).tolist() for d in range(len(store))] == [task.tokenize(documents[d]).tolist() for d in range(len(documents))]
    byte_store = task_for(corpus).token_stores("train")[1]
    assert byte_store.path != store.path and byte_store.tokens.dtype == np.uint16  # 260 ids: more than a byte


# ---- each rank reads only its rows; resume is a seek ---------------------------------------


class Reads:
    """Counts what is tokenized and which samples are read, through the real code paths."""

    def __init__(self, monkeypatch, tokenizer):
        self.tokenized, self.samples = 0, []
        encode_batch = tokenizer.encode_batch
        get_item = EpochSamples.__getitem__

        def counting_encode(texts):
            self.tokenized += len(texts)
            return encode_batch(texts)

        def counting_get_item(samples, index):
            self.samples.append(index)
            return get_item(samples, index)

        monkeypatch.setattr(tokenizer, "encode_batch", counting_encode)
        monkeypatch.setattr(EpochSamples, "__getitem__", counting_get_item)


def test_each_rank_reads_only_its_rows_and_tokenizes_nothing_once_the_store_exists(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", texts(80, 5))
    builder = task_for(data, sample_break_mode="complete")
    reads = Reads(monkeypatch, builder.tokenizer)
    builder.token_stores("train")
    assert reads.tokenized == 80  # every document tokenized once, by the first process
    read_by_rank = []
    for rank in range(2):
        task = task_for(data, sample_break_mode="complete")
        reads = Reads(monkeypatch, task.tokenizer)
        batches = list(task.get_batch_iterator("train", batch_size=3, seed=2, num_shards=2, shard_id=rank).next_epoch_itr())
        assert reads.tokenized == 0
        assert sorted(reads.samples) == sorted(int(i) for b in batches for i in b["id"])  # its rows, each once
        read_by_rank.append(set(reads.samples))
    assert not read_by_rank[0] & read_by_rank[1]
    assert all(i // 3 % 2 == rank for rank, ids in enumerate(read_by_rank) for i in ids)


@pytest.mark.parametrize("num_workers, buffer", [(0, 10), (0, 0), (2, 4)], ids=["thread", "in_step", "dataloader"])
def test_resume_is_a_seek_that_reads_only_the_batches_taken(corpus, monkeypatch, num_workers, buffer):
    task = task_for(corpus, sample_break_mode="complete")

    def iterator():
        return task.get_batch_iterator("train", batch_size=2, seed=7, num_shards=2, shard_id=1,
                                       num_workers=num_workers, data_buffer_size=buffer)

    epoch = iterator().next_epoch_itr()
    all_batches = list(epoch)
    resumed = iterator()
    resumed.load_state_dict({"epoch": 1, "iterations_in_epoch": 10})
    reads = Reads(monkeypatch, task.tokenizer)
    itr = resumed.next_epoch_itr()
    first = next(itr)
    assert [first["id"].tolist(), first["net_input"]["src_tokens"].tolist()] == [
        all_batches[10]["id"].tolist(), all_batches[10]["net_input"]["src_tokens"].tolist()]
    assert itr.n == 11 and reads.tokenized == 0
    if num_workers == 0:  # (worker processes read in their own address space)
        assert set(reads.samples) <= {int(i) for b in all_batches[10 : 10 + 1 + buffer] for i in b["id"]}
    assert [b["id"].tolist() for b in itr] == [b["id"].tolist() for b in all_batches[11:]]


def test_background_loading_gives_the_same_batches_and_stops_with_its_consumer(corpus):
    task = task_for(corpus, sample_break_mode="none")
    ways = {}
    for name, workers, buffer in (("in_step", 0, 0), ("thread", 0, 3), ("dataloader", 2, 4)):
        itr = task.get_batch_iterator("train", batch_size=4, seed=3, num_workers=workers, data_buffer_size=buffer)
        ways[name] = [(b["id"].tolist(), b["target"].tolist(), b["ntokens"]) for b in itr.next_epoch_itr()]
    assert ways["thread"] == ways["in_step"] == ways["dataloader"] and len(ways["thread"]) > 5
    def prefetching():
        return [t for t in threading.enumerate() if t.name == "metaseq_ds batch prefetch"]

    itr = task.get_batch_iterator("train", batch_size=4, seed=3, data_buffer_size=2).next_epoch_itr()
    next(itr)
    assert prefetching()
    del itr  # a consumer that stops early (max-valid-steps, the end of training)
    deadline = time.monotonic() + 5
    while prefetching() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not prefetching()


EXIT_WHILE_PREFETCHING = """
import torch
from metaseq_ds.data.prefetch import background_batches

class SlowBatches:
    def __len__(self):
        return 1000

    def __getitem__(self, index):
        a = torch.randn(1500, 1500)
        return {"x": a @ a}  # torch multiplies without the GIL: the thread is inside C++ most of the time

batches = background_batches(SlowBatches, num_workers=0, buffer_size=2)
next(batches)
"""


def test_a_process_that_exits_while_a_batch_is_being_made_exits_cleanly():
    """Left to the interpreter's finalisation, the thread would be ended inside torch's C++ code:
    "terminate called without an active exception", exit 134 (every time, before the fix)."""
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", EXIT_WHILE_PREFETCHING], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-2000:]


def test_an_error_while_loading_reaches_the_consumer(corpus):
    def broken():
        raise UsageError("split 'train' (epoch 1) yields no full micro-batch")

    with pytest.raises(UsageError, match="no full micro-batch"):
        next(background_batches(broken, num_workers=0, buffer_size=2))


# ---- the store: keyed, checked, atomic, locked, parallel ------------------------------------


def store_dirs(data):
    return sorted(p.name for p in (data / STORE_DIR_NAME / "train" / "00").iterdir() if p.is_dir())


def test_a_changed_file_tokenizer_or_end_of_document_symbol_selects_another_store(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", ["one document", "another one"])
    first = task_for(data).token_stores("train")[0]
    assert task_for(data).token_stores("train")[0].path == first.path  # reused
    vocab, merges, _ = train_bpe(tmp_path / "bpe")
    bpe = task_for(data, vocab_filename=str(vocab), merges_filename=str(merges)).token_stores("train")[0]
    other_eod = task_for(data, end_of_document_symbol="<s>").token_stores("train")[0]
    assert other_eod.document(0)[-1] == 0 and first.document(0)[-1] == 2
    assert len({first.path, bpe.path, other_eod.path}) == 3 and len(store_dirs(data)) == 3
    write_jsonl(data / "train" / "00" / "a.jsonl", ["one document changed", "another one"])
    changed = task_for(data).token_stores("train")[0]
    assert changed.path != first.path and len(changed.document(0)) == len("one document changed") + 1
    assert store_dirs(data) == [changed.path.name]  # stores of the old file are gone: no run can use them


def test_a_store_of_another_tokenizer_is_rebuilt_never_misread(tmp_path, caplog):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", ["alpha beta gamma", "delta"])
    vocab, merges, _ = train_bpe(tmp_path / "bpe")
    bpe_task = task_for(data, vocab_filename=str(vocab), merges_filename=str(merges))
    bpe_store = bpe_task.token_stores("train")[0]
    byte_task = task_for(data)
    byte_path = byte_task.token_stores("train")[0].path
    for name in ("tokens.bin", "offsets.npy", "meta.json"):  # a store copied over another
        (byte_path / name).write_bytes((bpe_store.path / name).read_bytes())
    with caplog.at_level(logging.WARNING):
        rebuilt = byte_task.token_stores("train")[0]
    assert "not usable (built from other files or another tokenizer): rebuilding it" in caplog.text
    assert rebuilt.document(0).tolist() == byte_task.tokenize("alpha beta gamma").tolist()
    (byte_path / "tokens.bin").write_bytes(b"\0" * 6)  # truncated
    assert task_for(data).token_stores("train")[0].document(1).tolist() == byte_task.tokenize("delta").tolist()


def test_a_malformed_line_stops_the_build_naming_file_and_line_and_leaves_no_store(tmp_path, monkeypatch):
    monkeypatch.setattr(store_builder, "CHUNK_BYTES", 200)  # many chunks: line numbers add up across them
    data = tmp_path / "data"
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(40)]
    lines[29] = '{"text": oops}'
    lines[5] = ""  # blank lines count as lines
    (data / "train" / "00").mkdir(parents=True)
    (data / "train" / "00" / "a.jsonl").write_text("\n".join(lines[:10]) + "\n")
    (data / "train" / "00" / "b.jsonl").write_text("\n".join(lines[10:]) + "\n")
    for workers in (1, 2):
        with pytest.raises(UsageError, match=r"b\.jsonl:20: not a JSON object"):
            task_for(data).token_stores("train", workers=workers)
        left = [p.name for p in (data / STORE_DIR_NAME / "train" / "00").iterdir()]
        assert all(name.endswith(".lock") for name in left), left  # no store, no temporary directory


def test_parallel_build_writes_the_same_store_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(store_builder, "CHUNK_BYTES", 1000)
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", texts(150, 8))
    write_jsonl(data / "train" / "00" / "b.jsonl", texts(50, 9))
    task = task_for(data)
    serial = open_store(tmp_path / "serial", "train", data / "train" / "00", task.tokenizer, task.eod, workers=1)
    parallel = open_store(tmp_path / "parallel", "train", data / "train" / "00", task.tokenizer, task.eod, workers=2)
    assert np.array_equal(serial.offsets, parallel.offsets) and np.array_equal(serial.tokens, parallel.tokens)
    documents = JsonlSplit(data, "train").documents(1)
    assert [parallel.document(d).tolist() for d in (0, 77, 199)] == [task.tokenize(documents[d]).tolist() for d in (0, 77, 199)]


def test_a_parallel_gpt2_bpe_build_holds_what_the_tokenizer_encodes(tmp_path, monkeypatch):
    """Worker processes take the ASCII fast path of byte-level BPE (`bytelevel_ascii`) on their
    own, each with its own cache; documents with other characters go to the library."""
    monkeypatch.setattr(store_builder, "CHUNK_BYTES", 2000)
    vocab, merges, _ = train_bpe(tmp_path / "bpe")
    data = tmp_path / "data"
    docs = [document(n) + ("" if n % 7 else " caf\u00e9 </s> \u4e2d") + ("  it's 42!\n" if n % 3 else "") for n in range(120)]
    write_jsonl(data / "train" / "00" / "a.jsonl", docs)
    task = task_for(data, vocab_filename=str(vocab), merges_filename=str(merges))
    store = open_store(tmp_path / "stores", "train", data / "train" / "00", task.tokenizer, task.eod, workers=2)
    expected = [task.tokenizer.tokenizer.encode(doc.rstrip(), add_special_tokens=False).ids + [task.eod] for doc in docs]
    assert [store.document(d).tolist() for d in range(len(store))] == expected


def test_tokenizing_workers_start_without_torch():
    """Each worker process imports what it runs; torch would add seconds to every build's start."""
    code = (
        "import sys\n"
        "import metaseq_ds.data.store_builder, metaseq_ds.data.tokenizers\n"
        "from metaseq_ds.data import ByteTokenizer\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

def test_the_first_process_builds_while_the_others_wait(tmp_path):
    from filelock import FileLock

    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", texts(300, 10))
    script = (
        "import logging, sys; sys.path.insert(0, %r)\n"
        "logging.basicConfig(level=logging.INFO, format='%%(message)s')\n"
        "from data_fixtures import make_task\n"
        "print(make_task(%r, tokens_per_sample=8).token_stores('train', workers=1)[0].path)\n"
    ) % (str(Path(__file__).parent), str(data))
    task = task_for(data)
    folder = data / STORE_DIR_NAME / "train" / "00"
    folder.mkdir(parents=True)
    key = StoreRequest.for_shard(data / "train" / "00", task.tokenizer, task.eod).key
    with FileLock(str(folder / f"{key}.lock")):  # both processes start while the lock is taken
        processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for _ in range(2)]
        time.sleep(1.0)
        assert all(p.poll() is None for p in processes)  # waiting, not building
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(folder / key)}
    assert sum(err.count("tokenized") for _, err in outputs) == 1, outputs


def test_the_store_goes_beside_the_data_or_into_the_cache_dir(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", ["one", "two"])
    cache = tmp_path / "cache"
    store = task_for(data, data_cache_dir=str(cache)).token_stores("train")[0]
    assert store.path.is_relative_to(store_root(data, str(cache))) and store.path.is_relative_to(cache)
    assert not (data / STORE_DIR_NAME).exists()
    (data / STORE_DIR_NAME).write_text("not a directory")  # as a read-only data directory would
    with pytest.raises(UsageError, match=r"cannot write the token store in .*; give --data-cache-dir DIR"):
        task_for(data).token_stores("train")


def test_a_store_pickles_without_its_tokens(corpus):
    import pickle

    store = task_for(corpus).token_stores("train")[0]
    store.document(0)
    copy = pickle.loads(pickle.dumps(store))
    assert isinstance(copy, TokenStore) and len(pickle.dumps(store)) < store.tokens.nbytes
    assert copy.document(3).tolist() == store.document(3).tolist()



# ---- mseq preprocess -----------------------------------------------------------------------


def test_preprocess_builds_every_split_so_that_training_tokenizes_nothing(corpus, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from metaseq_ds.cli.main import app

    cache = tmp_path / "cache"
    env = {"COLUMNS": "150", "TERM": "dumb", "NO_COLOR": "1"}
    result = CliRunner().invoke(app, ["preprocess", str(corpus), "--workers", "2", "--data-cache-dir", str(cache)], env=env)
    assert result.exit_code == 0, result.output
    table = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [line.split("│")[1:3] for line in table] == [[" train ", " 00    "], [" train ", " 01    "], [" valid ", " 00    "]]
    assert all("built in" in line for line in table)
    again = CliRunner().invoke(app, ["preprocess", str(corpus), "--data-cache-dir", str(cache)], env=env)
    assert [line.count("existed") for line in again.stdout.splitlines() if line.startswith("│")] == [1, 1, 1]
    task = task_for(corpus, data_cache_dir=str(cache))
    reads = Reads(monkeypatch, task.tokenizer)
    next(task.get_batch_iterator("train", batch_size=2).next_epoch_itr())
    next(task.get_batch_iterator("valid", batch_size=2).next_epoch_itr())
    assert reads.tokenized == 0


def test_preprocess_of_a_malformed_corpus_is_one_line_and_exit_2(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "00" / "a.jsonl", ["fine"])
    with open(data / "train" / "00" / "a.jsonl", "a") as f:
        f.write('{"txt": "no text field"}\n')
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "preprocess", str(data)], capture_output=True, text=True)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("mseq preprocess: error:")]
    assert errors == [f'mseq preprocess: error: {data}/train/00/a.jsonl:2: needs a JSON object with a "text" string field']
    assert "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "preprocess", str(tmp_path / "nowhere")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "DATA: directory" in result.stderr
