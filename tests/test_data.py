"""metaseq_ds.data: dictionary, tokenizers, jsonl layout, break modes, batching, demo corpus."""

import json

import numpy as np
import pytest
import torch

from data_fixtures import document, train_bpe, write_corpus, write_jsonl
from metaseq_ds.data import (
    ByteTokenizer,
    CountingIterator,
    Dictionary,
    EpochBatchIterator,
    JsonlDataset,
    JsonlSplit,
    build_demo_corpus,
    build_tokenizer,
    collate_blocks,
    document_blocks,
    list_splits,
    unigram_entropy,
)
from metaseq_ds.data.iterators import rank_rows, collated_batches
from metaseq_ds.errors import UsageError

PAD = 1


def arrays(*lengths, start=10):
    """Documents as token arrays with distinct consecutive values, ending in eos (2)."""
    docs, value = [], start
    for n in lengths:
        docs.append(np.array(list(range(value, value + n - 1)) + [2], dtype=np.int64))
        value += n
    return docs


# ---- dictionary and tokenizers -------------------------------------------------------------


def test_dictionary_has_opt_special_ids_and_pads_like_metaseq():
    d = Dictionary(f"w{i}" for i in range(50265 - 4))
    assert (d.bos(), d.pad(), d.eos(), d.unk()) == (0, 1, 2, 3)
    assert [d[i] for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    d.pad_to_multiple_(8)
    assert len(d) == 50272  # GPT-2 BPE -> OPT's vocabulary size
    assert d.index("w7") == 11 and d.index("never seen") == d.unk()
    assert d.string(torch.tensor([4, 5, 1, 1])) == "w0 w1"


def test_byte_tokenizer_round_trips_text_and_reserves_special_ids():
    tok = ByteTokenizer()
    text = "naïve café — 東京\n\tend"
    ids = tok.encode(text)
    assert ids[:2] == [4 + ord("n"), 4 + ord("a")]
    assert min(ids) >= 4 and max(ids) < tok.vocab_size == 260
    assert tok.decode(ids) == text
    assert tok.decode([0, 2, *ids, 1, 300]) == text  # specials and out-of-range ids are skipped
    assert [tok.token_to_id(s) for s in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert tok.token_to_id(tok.id_to_token(4 + 200)) == 4 + 200


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    vocab, merges, _ = train_bpe(tmp_path)
    tok = build_tokenizer(None, str(vocab), str(merges))
    ids = tok.encode(document(3))
    assert len(ids) < len(document(3)) / 2  # merges were applied
    assert tok.decode(ids) == document(3)
    assert [tok.token_to_id(s) for s in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]


def test_hf_tokenizer_json_is_loaded_and_its_post_processor_specials_are_not_added(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    _, _, tokenizer_json = train_bpe(tmp_path)
    raw = Tokenizer.from_file(str(tokenizer_json))
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(tokenizer_json))
    tok = build_tokenizer(str(tokenizer_json), None, None)
    ids = tok.encode("alpha beta")
    assert ids and ids[0] != 0
    assert tok.decode(ids) == "alpha beta"


def test_tokenizer_without_opt_special_ids_is_rejected_naming_the_file(tmp_path):
    vocab, merges, tokenizer_json = train_bpe(tmp_path, special_tokens=("<pad>", "<s>", "</s>", "<unk>"))
    with pytest.raises(UsageError, match=rf"--vocab-filename {vocab}: id 0 must be '<s>'"):
        build_tokenizer(None, str(vocab), str(merges))
    with pytest.raises(UsageError, match=rf"--hf-tokenizer {tokenizer_json}: id 0"):
        build_tokenizer(str(tokenizer_json), None, None)


def test_tokenizer_flag_errors_name_the_flag(tmp_path):
    vocab, merges, _ = train_bpe(tmp_path)
    with pytest.raises(UsageError, match="needs --merges-filename"):
        build_tokenizer(None, str(vocab), None)
    with pytest.raises(UsageError, match="needs --vocab-filename"):
        build_tokenizer(None, "", str(merges))
    with pytest.raises(UsageError, match="--hf-tokenizer: file .*missing.json does not exist"):
        build_tokenizer(str(tmp_path / "missing.json"), None, None)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UsageError, match="--hf-tokenizer: cannot load"):
        build_tokenizer(str(tmp_path / "broken.json"), None, None)
    assert isinstance(build_tokenizer("", "", ""), ByteTokenizer)  # metaseq configs store "" for unset


# ---- jsonl layout --------------------------------------------------------------------------


def test_layout_discovery_finds_train_shards_and_named_valid_subsets(tmp_path):
    write_corpus(tmp_path, {"train/00": 4, "train/01": 6, "valid/00": 2, "valid/books/00": 3})
    assert list_splits(tmp_path) == ["train", "valid", "valid/books"]
    train = JsonlSplit(tmp_path, "train")
    assert [p.name for p in train.shards] == ["00", "01"]
    # epoch e reads shard (e - 1) % K, as metaseq
    assert [train.shard_for_epoch(e).name for e in (1, 2, 3, 4)] == ["00", "01", "00", "01"]
    assert len(train.documents(1)) == 4 and len(train.documents(2)) == 6
    assert train.documents(2)[0] == document(4)
    books = JsonlSplit(tmp_path, "valid/books")
    assert [books.documents(1)[i] for i in range(3)] == [document(n) for n in (12, 13, 14)]


def test_jsonl_is_read_lazily_skipping_blank_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "meta": 1}\n   \n{"text": "three"}')
    docs = JsonlDataset(path)
    assert len(docs) == 3 and [docs[i] for i in range(3)] == ["one", "two", "three"]
    path.write_text('{"text": "uno"}\n\n{"text": "dos", "meta": 1}\n   \n{"text": "tres"}')
    assert docs[2] == "tres"  # read on demand from the indexed offsets


@pytest.mark.parametrize(
    "line, problem",
    [("{not json", "not a JSON object"), ('{"txt": "x"}', '"text" string field'), ('{"text": 5}', '"text" string field'), ("[1]", '"text"')],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "train" / "00" / "bad.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    docs = JsonlDataset(path)
    with pytest.raises(UsageError, match=rf"{path}:3: .*{problem}"):
        docs[1]


def test_layout_errors_are_one_line_and_say_what_is_expected(tmp_path):
    with pytest.raises(UsageError, match=r"DATA: directory .*nowhere does not exist"):
        JsonlSplit(tmp_path / "nowhere", "train")
    (tmp_path / "train" / "00").mkdir(parents=True)
    (tmp_path / "train" / "00" / "notes.txt").write_text("no jsonl here")
    with pytest.raises(UsageError, match=r"train has no shard directories 00, 01, \.\.\. with \*\.jsonl files"):
        JsonlSplit(tmp_path, "train")
    with pytest.raises(UsageError, match=r"no split 'valid'"):
        JsonlSplit(tmp_path, "valid")
    write_corpus(tmp_path, {"valid/books/00": 2, "train/00": 2, "train/02": 2})
    with pytest.raises(UsageError, match=r"named subsets here: valid/books"):
        JsonlSplit(tmp_path, "valid")
    with pytest.raises(UsageError, match=r"numbered 00\.\.01 without gaps, found \[0, 2\]"):
        JsonlSplit(tmp_path, "train")
    write_jsonl(tmp_path / "empty" / "00" / "e.jsonl", [])
    with pytest.raises(UsageError, match="holds no documents"):
        JsonlSplit(tmp_path, "empty").documents(1)


# ---- break modes and collation -------------------------------------------------------------


def test_break_mode_none_concatenates_and_cuts_full_blocks():
    docs = arrays(3, 7, 4)  # 14 tokens
    blocks = list(document_blocks(iter(docs), 5, "none", drop_last=True))
    assert [len(b) for b in blocks] == [5, 5]
    assert np.concatenate(blocks).tolist() == np.concatenate(docs)[:10].tolist()
    kept = list(document_blocks(iter(docs), 5, "none", drop_last=False))
    assert [len(b) for b in kept] == [5, 5, 4]


def test_break_mode_complete_packs_whole_documents_and_splits_long_ones():
    docs = arrays(3, 2, 4, 11, 1)
    blocks = [b.tolist() for b in document_blocks(iter(docs), 5, "complete", drop_last=True)]
    pieces = [d.tolist() for d in docs]
    long = pieces[3]
    assert blocks == [pieces[0] + pieces[1], pieces[2], long[:5], long[5:10], long[10:] + pieces[4]]


def test_one_document_modes_split_or_truncate_and_skip_single_tokens():
    docs = arrays(3, 1, 11, 12)  # 1 token: nothing to predict; 11 = 5 + 5 + 1; 12 = 5 + 5 + 2
    eleven, twelve = docs[2].tolist(), docs[3].tolist()
    eos_pad_8 = [b.tolist() for b in document_blocks(iter(docs), 5, "eos_pad_8", drop_last=True)]
    assert eos_pad_8 == [docs[0].tolist(), eleven[:5], eleven[5:10], twelve[:5], twelve[5:10], twelve[10:]]
    passthrough = [b.tolist() for b in document_blocks(iter(docs), 5, "passthrough", drop_last=True)]
    assert passthrough == [docs[0].tolist(), eleven[:5], twelve[:5]]


def test_collate_gives_shifted_src_and_target_with_padding():
    block = np.array([10, 11, 12, 2], dtype=np.int64)
    batch = collate_blocks([(7, block), (8, None)], pad=PAD, tokens_per_sample=6, break_mode="complete")
    assert batch["id"].tolist() == [7, 8]
    assert batch["net_input"]["src_tokens"].tolist() == [[10, 11, 12, 2, 1, 1], [1] * 6]
    assert batch["target"].tolist() == [[11, 12, 2, 1, 1, 1], [1] * 6]
    assert batch["ntokens"] == 3 and batch["nsentences"] == 1


@pytest.mark.parametrize("mode, width", [("none", 20), ("complete", 20), ("eos_pad_8", 16), ("passthrough", 9)])
def test_collate_width_per_break_mode(mode, width):
    rows = [(0, np.arange(10, 20)), (1, np.arange(30, 33))]  # longest sample: 10 tokens -> 9 positions
    batch = collate_blocks(rows, pad=PAD, tokens_per_sample=20, break_mode=mode)
    assert batch["net_input"]["src_tokens"].shape == (2, width)
    assert batch["target"].shape == (2, width)
    assert batch["ntokens"] == 9 + 2
    assert collate_blocks(rows, PAD, 12, "eos_pad_8")["target"].shape == (2, 12)  # 16 capped at 12


# ---- rank split and resumable iterator -------------------------------------------------------


def test_rank_rows_split_global_batches_the_same_for_any_number_of_ranks():
    samples = [np.array([i]) for i in range(21)]
    one = [[i for i, _ in rows] for rows in rank_rows(iter(samples), 8, 1, 0, fill_last=False)]
    two = [
        [i for i, _ in r0 + r1]
        for r0, r1 in zip(rank_rows(iter(samples), 4, 2, 0, False), rank_rows(iter(samples), 4, 2, 1, False))
    ]
    assert one == two == [list(range(8)), list(range(8, 16))]  # last incomplete global batch dropped
    filled = list(rank_rows(iter(samples), 4, 2, 1, fill_last=True))
    assert len(filled) == 3
    assert [s is None for _, s in filled[-1]] == [False, True, True, True]  # rows 20 (real), 21-23 (filler)
    assert [i for i, _ in filled[-1]] == [20, 21, 22, 23]
    with pytest.raises(ValueError):
        next(rank_rows(iter(samples), 4, 2, 2, False))


def test_counting_iterator_counts_and_peeks():
    itr = CountingIterator(iter("abc"), start=5)
    assert itr.has_next() and itr.n == 5
    assert next(itr) == "a" and itr.n == 6
    assert list(itr) == ["b", "c"] and itr.n == 8 and not itr.has_next()


def counting_epochs(lengths):
    """An EpochBatchIterator whose epoch e yields (e, 0), (e, 1), ..., lengths[e-1] - 1 batches."""

    def batches_for_epoch(epoch, skip):
        return iter([(epoch, i) for i in range(skip, lengths[(epoch - 1) % len(lengths)])])

    return EpochBatchIterator(batches_for_epoch)


def test_epoch_batch_iterator_resumes_mid_epoch_and_at_epoch_boundary():
    original = counting_epochs([5, 3])
    itr = original.next_epoch_itr()
    assert [next(itr) for _ in range(2)] == [(1, 0), (1, 1)]
    state = original.state_dict()
    assert state == {"epoch": 1, "iterations_in_epoch": 2}
    resumed = counting_epochs([5, 3])
    resumed.load_state_dict(state)
    assert resumed.iterations_in_epoch == 2 and resumed.next_epoch_idx == 1
    assert list(resumed.next_epoch_itr()) == list(itr) == [(1, 2), (1, 3), (1, 4)]
    assert original.end_of_epoch() and original.state_dict() == {"epoch": 2, "iterations_in_epoch": 0}
    again = counting_epochs([5, 3])
    again.load_state_dict(original.state_dict())
    assert list(again.next_epoch_itr()) == list(original.next_epoch_itr()) == [(2, 0), (2, 1), (2, 2)]
    assert original.epoch == again.epoch == 2


def test_an_epoch_without_a_full_batch_is_a_usage_error():
    rows = rank_rows(iter([np.array([1, 2])] * 3), 4, 1, 0, fill_last=False)
    with pytest.raises(UsageError, match=r"split 'train' \(epoch 1\) yields no full micro-batch"):
        list(collated_batches(rows, 0, lambda r: r, what="split 'train' (epoch 1)"))


# ---- demo corpus ---------------------------------------------------------------------------


def test_demo_corpus_is_deterministic_reused_and_in_metaseq_layout(tmp_path):
    first = build_demo_corpus(tmp_path / "a", max_bytes=40_000)
    second = build_demo_corpus(tmp_path / "b", max_bytes=40_000)
    assert list_splits(first) == ["train", "valid"]
    train = (first / "train" / "00" / "stdlib.jsonl").read_bytes()
    assert train == (second / "train" / "00" / "stdlib.jsonl").read_bytes()
    assert (first / "valid" / "00" / "stdlib.jsonl").read_bytes() == (second / "valid" / "00" / "stdlib.jsonl").read_bytes()
    assert 40_000 <= len(train) < 400_000
    assert all(json.loads(line)["text"].strip() for line in train.decode().splitlines())
    stamp = (first / "train" / "00" / "stdlib.jsonl").stat().st_mtime_ns
    assert build_demo_corpus(tmp_path / "a", max_bytes=40_000) == first
    assert (first / "train" / "00" / "stdlib.jsonl").stat().st_mtime_ns == stamp  # reused, not rewritten
    bigger = build_demo_corpus(tmp_path / "a", max_bytes=80_000)  # another size replaces it
    assert (bigger / "train" / "00" / "stdlib.jsonl").stat().st_size > len(train)
    (tmp_path / "mine").mkdir()
    with pytest.raises(UsageError, match="is not a demo corpus"):
        build_demo_corpus(tmp_path / "mine", max_bytes=40_000)


def test_unigram_entropy_counts_bytes_and_one_eos_per_document(tmp_path):
    write_jsonl(tmp_path / "valid" / "00" / "a.jsonl", ["ab  \n", "b"])  # tokens: a b </s> b </s>
    p = np.array([1, 2, 2]) / 5
    assert unigram_entropy(tmp_path, "valid") == pytest.approx(float(-(p * np.log2(p)).sum()))
