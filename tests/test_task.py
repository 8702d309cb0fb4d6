"""metaseq_ds.tasks: registry, task bases, and the streaming LM task's data contract."""

import dataclasses
from argparse import Namespace
from dataclasses import dataclass, field

import pytest
import torch

import metaseq_ds.tasks.streaming_language_modeling as slm
from data_fixtures import document, make_task, train_bpe, write_corpus
from metaseq_ds.data import ByteTokenizer, HuggingFaceTokenizer, build_demo_corpus
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.errors import UsageError
from metaseq_ds.tasks import TASK_REGISTRY, BaseTask, LegacyTask, register_task, setup_task
from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig, StreamingLanguageModelingTask

LAYOUT = {"train/00": 40, "train/01": 30, "valid/00": 9, "valid/books/00": 5}


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "data", LAYOUT)


def take(itr, n=None):
    return [b for _, b in zip(range(n), itr)] if n is not None else list(itr)


def rows(batch):
    """(sample id, src row, target row) of every row of a batch, as lists."""
    src, target = batch["net_input"]["src_tokens"], batch["target"]
    return [(int(i), s.tolist(), t.tolist()) for i, s, t in zip(batch["id"], src, target)]


def unpadded(row_list, pad=1):
    return [(i, [x for x in s if x != pad], [x for x in t if x != pad]) for i, s, t in row_list]


# ---- registry and bases --------------------------------------------------------------------


def test_streaming_lm_is_registered_with_a_fully_documented_config(corpus):
    entry = TASK_REGISTRY.get("streaming_language_modeling")
    assert entry.cls is StreamingLanguageModelingTask and entry.dataclass is StreamingLanguageModelingConfig
    assert all(f.metadata.get("help") for f in dataclasses.fields(StreamingLanguageModelingConfig))
    task = make_task(corpus)
    assert isinstance(task, StreamingLanguageModelingTask)
    assert task.max_positions() == 16 and task.source_dictionary is task.target_dictionary
    with pytest.raises(UsageError, match="--task: unknown task 'streaming_languge_modeling'; did you mean"):
        TASK_REGISTRY.get("streaming_languge_modeling")


def test_fairseq_style_plugin_tasks_register_and_set_up(monkeypatch):
    monkeypatch.setattr(TASK_REGISTRY, "entries", dict(TASK_REGISTRY.entries))  # keep the test's tasks out of others' --help
    @dataclass
    class EchoConfig(MetaseqDataclass):
        size: int = field(default=3, metadata={"help": "how many"})

    @register_task("test_echo_task", dataclass=EchoConfig)
    class EchoTask(BaseTask):
        @classmethod
        def setup_task(cls, cfg, **kwargs):
            return cls(cfg, **kwargs)

    @register_task("test_legacy_echo_task")
    class LegacyEchoTask(LegacyTask):
        @staticmethod
        def add_args(parser):
            parser.add_argument("--size", type=int, default=3)

    task = setup_task(EchoConfig(size=5))
    assert isinstance(task, EchoTask) and task.cfg.size == 5 and task.datasets == {}
    args = Namespace(size=7)
    args._name = "test_legacy_echo_task"
    legacy = setup_task(args)
    assert isinstance(legacy, LegacyEchoTask) and legacy.args is args and legacy.args.size == 7
    with pytest.raises(KeyError, match="dataset not loaded: valid"):
        legacy.dataset("valid")
    with pytest.raises(ValueError, match="must extend BaseTask"):
        register_task("test_not_a_task")(object)


class FakeCriterion:
    logged = None

    def __call__(self, model, sample):
        loss = (model.weight * sample).sum()
        return loss, 1, {"loss": loss.item(), "training": model.training, "grad": torch.is_grad_enabled()}

    @staticmethod
    def reduce_metrics(logging_outputs):
        FakeCriterion.logged = logging_outputs


class FakeOptimizer:
    def backward(self, loss):
        loss.backward()


def test_train_step_and_valid_step_drive_model_criterion_and_optimizer():
    task, model, criterion = BaseTask(None), torch.nn.Linear(2, 1), FakeCriterion()
    sample = torch.ones(1, 2)
    model.eval()
    loss, size, log = task.train_step(sample, model, criterion, FakeOptimizer(), update_num=0)
    assert log["training"] and size == 1
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
    model.zero_grad()
    loss, _, _ = task.train_step(sample, model, criterion, FakeOptimizer(), update_num=1, ignore_grad=True)
    assert loss.item() == 0 and torch.equal(model.weight.grad, torch.zeros(1, 2))
    _, _, log = task.valid_step(sample, model, criterion)
    assert not log["training"] and not log["grad"]
    task.reduce_metrics([log], criterion)
    assert FakeCriterion.logged == [log]


# ---- tokenizer and dictionary choice -------------------------------------------------------


def test_tokenizer_choice_hf_over_bpe_over_bytes(corpus, tmp_path):
    vocab, merges, tokenizer_json = train_bpe(tmp_path / "bpe")
    byte_task = make_task(corpus)
    assert isinstance(byte_task.tokenizer, ByteTokenizer) and len(byte_task.dictionary) == 264
    bpe_task = make_task(corpus, vocab_filename=str(vocab), merges_filename=str(merges))
    assert isinstance(bpe_task.tokenizer, HuggingFaceTokenizer)
    assert len(bpe_task.dictionary) == -(-bpe_task.tokenizer.vocab_size // 8) * 8 > 260
    assert bpe_task.dictionary[300] == bpe_task.tokenizer.id_to_token(300)
    hf_task = make_task(corpus, hf_tokenizer=str(tokenizer_json), vocab_filename="ignored.json")
    assert hf_task.tokenize("alpha beta").tolist() == bpe_task.tokenize("alpha beta  ").tolist()
    assert hf_task.tokenize("alpha").tolist()[-1] == hf_task.eod == 2
    with pytest.raises(UsageError, match="needs --merges-filename"):
        make_task(corpus, vocab_filename=str(vocab))


def test_final_vocab_size_and_end_of_document_symbol(corpus):
    assert len(make_task(corpus, final_vocab_size=300).dictionary) == 300
    with pytest.raises(UsageError, match=r"--final-vocab-size 100 is smaller than the tokenizer's vocabulary \(260\)"):
        make_task(corpus, final_vocab_size=100)
    with pytest.raises(UsageError, match="--end-of-document-symbol '<eod>' is not in"):
        make_task(corpus, end_of_document_symbol="<eod>")
    with pytest.raises(UsageError, match="DATA: directory"):
        make_task(corpus / "missing")


def test_no_data_dir_means_the_demo_corpus(tmp_path, monkeypatch):
    demo = build_demo_corpus(tmp_path / "demo", max_bytes=20_000)
    monkeypatch.setattr(slm, "build_demo_corpus", lambda: demo)
    task = setup_task(StreamingLanguageModelingConfig(tokens_per_sample=32))
    assert task.data_dir == demo
    batch = next(task.get_batch_iterator("valid", batch_size=2).next_epoch_itr())
    assert batch["ntokens"] > 0


# ---- the batch iterator contract -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "complete", "eos_pad_8", "passthrough"])
def test_each_break_mode_yields_shifted_samples_of_the_right_width(corpus, mode):
    task = make_task(corpus, sample_break_mode=mode)
    batches = take(task.get_batch_iterator("train", batch_size=4, seed=3).next_epoch_itr())
    assert batches
    for batch in batches:
        src, target = batch["net_input"]["src_tokens"], batch["target"]
        assert src.shape == target.shape and src.shape[0] == 4 and src.dtype == torch.long
        assert src.shape[1] == 16 if mode in ("none", "complete") else src.shape[1] <= 16
        if mode == "eos_pad_8":
            assert src.shape[1] % 8 == 0
        assert batch["ntokens"] == int(target.ne(1).sum()) and batch["nsentences"] == 4
        assert torch.equal(src[:, 1:][target[:, :-1].ne(1)], target[:, :-1][target[:, :-1].ne(1)])
    text = ByteTokenizer().decode([t for b in batches for row in b["net_input"]["src_tokens"].tolist() for t in row])
    assert "alpha" in text or "beta" in text


def test_data_order_depends_on_seed_and_epoch_only(corpus):
    def first_epoch(seed, batch_size=4):
        return [rows(b) for b in task.get_batch_iterator("train", batch_size=batch_size, seed=seed).next_epoch_itr()]

    task = make_task(corpus)
    assert first_epoch(1) == [rows(b) for b in make_task(corpus).get_batch_iterator("train", 4, 1).next_epoch_itr()]
    assert first_epoch(1) != first_epoch(2)
    flat = [r for batch in first_epoch(1, batch_size=8) for r in batch]
    assert flat == [r for batch in first_epoch(1, batch_size=4) for r in batch][: len(flat)]


@pytest.mark.parametrize("mode", ["none", "eos_pad_8"])
def test_two_ranks_of_batch_4_see_the_rows_of_one_rank_of_batch_8(corpus, mode):
    task = make_task(corpus, sample_break_mode=mode)
    one = take(task.get_batch_iterator("train", batch_size=8, seed=5).next_epoch_itr())
    rank0 = take(task.get_batch_iterator("train", batch_size=4, seed=5, num_shards=2, shard_id=0).next_epoch_itr())
    rank1 = take(task.get_batch_iterator("train", batch_size=4, seed=5, num_shards=2, shard_id=1).next_epoch_itr())
    accumulated = take(task.get_batch_iterator("train", batch_size=4, seed=5).next_epoch_itr())
    assert len(one) == len(rank0) == len(rank1) >= 3
    for step, batch in enumerate(one):
        together = unpadded(rows(rank0[step]) + rows(rank1[step]))
        assert unpadded(rows(batch)) == together
        # --update-freq 2 with batch 4 on one rank: the same rows, two micro-batches per update
        assert unpadded(rows(accumulated[2 * step]) + rows(accumulated[2 * step + 1])) == together
    if mode == "none":
        assert torch.equal(one[0]["net_input"]["src_tokens"][4:], rank1[0]["net_input"]["src_tokens"])


def test_epochs_rotate_over_train_shards_and_the_last_partial_batch_is_dropped(corpus):
    task = make_task(corpus, sample_break_mode="passthrough", tokens_per_sample=512)  # a sample is a document
    epoch_itr = task.get_batch_iterator("train", batch_size=3, seed=1, num_shards=2)
    shard_documents = {1: range(0, 40), 2: range(40, 70), 3: range(0, 40)}  # shards 00, 01, 00 again
    for epoch, documents in shard_documents.items():
        batches = take(epoch_itr.next_epoch_itr())
        assert epoch_itr.epoch == epoch and epoch_itr.end_of_epoch()
        assert len(batches) == len(documents) // 6  # global batch 6; the remainder is dropped
        texts = [ByteTokenizer().decode(row) for b in batches for row in b["net_input"]["src_tokens"].tolist()]
        numbers = [int(text.rsplit(" doc", 1)[1]) for text in texts]
        assert set(numbers) <= set(documents) and len(set(numbers)) == len(numbers)


def test_valid_is_in_file_order_and_filled_up_so_ranks_stay_in_lockstep(corpus):
    task = make_task(corpus, sample_break_mode="passthrough")
    ranks = [take(task.get_batch_iterator("valid", batch_size=2, num_shards=2, shard_id=r).next_epoch_itr()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3  # 9 documents, global batch 4: 4 + 4 + 1 (+3 filler rows)
    assert all(b["net_input"]["src_tokens"].shape[0] == 2 for r in ranks for b in r)
    last = ranks[1][-1]
    assert last["ntokens"] == 0 and last["nsentences"] == 0 and last["target"].eq(1).all()
    assert ranks[0][-1]["nsentences"] == 1
    decoded = [ByteTokenizer().decode(ranks[r][s]["net_input"]["src_tokens"][i].tolist()) for s in range(2) for r in (0, 1) for i in (0, 1)]
    assert decoded == [document(70 + n)[:16] for n in range(8)]  # valid/00 holds documents 70..78, not shuffled
    books = take(task.get_batch_iterator("valid/books", batch_size=8).next_epoch_itr())
    assert len(books) == 1 and books[0]["nsentences"] == 5


def test_train_split_too_small_for_one_batch_is_a_usage_error(corpus):
    task = make_task(corpus, sample_break_mode="passthrough")
    with pytest.raises(UsageError, match="yields no full micro-batch"):
        take(task.get_batch_iterator("train", batch_size=64).next_epoch_itr())


@pytest.mark.parametrize("num_shards", [1, 2])
def test_resumed_iterator_yields_exactly_the_batches_the_original_would_have(corpus, num_shards):
    task = make_task(corpus, sample_break_mode="complete")

    def iterator(shard_id):
        return task.get_batch_iterator("train", batch_size=2, seed=7, num_shards=num_shards, shard_id=shard_id)

    for shard_id in range(num_shards):
        original = iterator(shard_id)
        epoch_1 = original.next_epoch_itr()
        first = take(epoch_1, 3)
        state = original.state_dict()
        assert state == {"epoch": 1, "iterations_in_epoch": 3}
        resumed = iterator(shard_id)
        resumed.load_state_dict(state)
        rest_of_epoch_1 = take(epoch_1)
        assert [rows(b) for b in take(resumed.next_epoch_itr())] == [rows(b) for b in rest_of_epoch_1]
        assert resumed.epoch == 1 and resumed.end_of_epoch()
        assert first and rest_of_epoch_1
        # across the epoch boundary: the state now points at the start of epoch 2, which reads shard 01
        at_boundary = iterator(shard_id)
        at_boundary.load_state_dict(original.state_dict())
        assert original.state_dict() == {"epoch": 2, "iterations_in_epoch": 0}
        epoch_2 = original.next_epoch_itr()
        assert [rows(b) for b in take(at_boundary.next_epoch_itr(), 4)] == [rows(b) for b in take(epoch_2, 4)]
        assert at_boundary.epoch == original.epoch == 2
        # and mid-epoch 2
        resumed_2 = iterator(shard_id)
        resumed_2.load_state_dict(original.state_dict())
        assert [rows(b) for b in take(resumed_2.next_epoch_itr())] == [rows(b) for b in take(epoch_2)]
