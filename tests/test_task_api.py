"""The task API of metaseq's BaseTask beyond training steps: `state` kept across checkpoints,
generation (`build_generator`, `inference_step`), dictionaries, size filtering, tokenizers."""

import io
import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import TINY, run, write_corpus
from metaseq_ds.checkpoint import files
from metaseq_ds.checkpoint.layout import Layout
from metaseq_ds.checkpoint.read import saved_client_state
from metaseq_ds.checkpoint.safe_loading import safe_load
from metaseq_ds.data import BaseDataset, ByteTokenizer, Dictionary
from metaseq_ds.dataclass import validate_config
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.options import get_generation_parser, parse_args_and_arch, parse_train_config
from metaseq_ds.sequence_generator import SequenceGenerator
from metaseq_ds.tasks import BaseTask, StatefulContainer, setup_task
from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig

PLUGIN = Path(__file__).parent / "plugins" / "stateful_task_plugin"


# ---- task state --------------------------------------------------------------------------------


def test_state_pieces_are_built_once_on_first_use_and_restored_without_building():
    built = []
    state = StatefulContainer()
    state.add_factory("vocab", lambda: built.append("vocab") or ["a", "b"])
    assert built == [] and state.state_dict == {}
    assert state.vocab == ["a", "b"] and state.vocab is state.vocab and built == ["vocab"]

    restored = StatefulContainer()
    restored.add_factory("vocab", lambda: built.append("again") or [])
    restored.merge_state_dict(state.state_dict)
    assert restored.vocab == ["a", "b"] and built == ["vocab"]  # the saved piece, not a new one
    assert StatefulContainer().state_dict == {}  # per instance (metaseq's were one class-level dict)
    with pytest.raises(AttributeError, match="Task state has no factory for attribute missing"):
        state.missing


def test_task_state_dict_round_trips_and_refuses_what_a_checkpoint_cannot_load():
    task = BaseTask(cfg=None)
    task.state.add_factory("dictionary", lambda: Dictionary(["hello", "world"]))
    task.state.add_factory("counts", lambda: {"tokens": torch.tensor([3, 4]), "seen": [1, (2, "x")]})
    task.state.dictionary, task.state.counts
    buffer = io.BytesIO()
    torch.save({"task_state": task.state_dict()}, buffer)  # as the trainer's client state
    buffer.seek(0)
    saved = safe_load(buffer)["task_state"]  # weights-only, as a resumed run reads it

    resumed = BaseTask(cfg=None)
    resumed.state.add_factory("dictionary", lambda: pytest.fail("restored state must not be rebuilt"))
    resumed.load_state_dict(saved)
    assert resumed.state.dictionary.symbols == task.state.dictionary.symbols
    assert torch.equal(resumed.state.counts["tokens"], torch.tensor([3, 4]))

    task.state.merge_state_dict({"mean": np.float64(0.5)})
    with pytest.raises(UsageError, match=r"task state\['mean'\] is a float64: checkpoints load with weights_only"):
        task.state_dict()


def test_plugin_task_state_survives_a_save_and_resume_of_mseq_train(tmp_path):
    corpus = write_corpus(tmp_path / "data", docs=40)
    save_dir = tmp_path / "ckpt"
    args = [str(corpus), *TINY, "--user-dir", str(PLUGIN), "--task", "token_counting_lm", "--batch-size", "2",
            "--save-interval-updates", "2", "--disable-validation", "--save-dir", str(save_dir)]

    def task_states(stdout):
        return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("TASK_STATE ")]

    first = task_states(run(args + ["--max-update", "2"]).stdout)
    resumed = task_states(run(args + ["--max-update", "4"]).stdout)
    assert [s["update"] for s in first] == [0, 1] and [s["update"] for s in resumed] == [2, 3]
    assert {s["built_by"] for s in first + resumed} == {first[0]["built_by"]}  # built once, then restored
    tokens_per_step = first[0]["tokens"]
    assert [s["tokens"] for s in first + resumed] == [tokens_per_step * n for n in (1, 2, 3, 4)]
    # A resharded resume reads the client state itself: the task state is part of it.
    ref = files.CheckpointRef(save_dir, "checkpoint_1_2")
    meta = ref.meta()
    saved = saved_client_state(ref, Layout.of_checkpoint(meta), meta)["task_state"]
    assert saved == {"token_counts": {"built_by": first[-1]["built_by"], "tokens": first[-1]["tokens"]}}


# ---- generation --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm():
    """The streaming LM task on bytes (no data is read) and a tiny random model of it."""
    cfg = parse_train_config(["/unused", "--arch", "transformer_lm_gpt2_tiny", "--tokens-per-sample", "32"])
    task = setup_task(validate_config(StreamingLanguageModelingConfig, {"tokens_per_sample": 32}))
    torch.manual_seed(0)
    return task, task.build_model(cfg.model).eval()


PROMPTS = [[2, 40, 41, 42], [2, 50]]


def test_build_generator_reads_metaseqs_generation_flags(lm):
    task, model = lm
    beams = task.build_generator([model], Namespace(beam=3, temperature=0.0, max_len_b=6, min_len=2, lenpen=1.0))
    assert isinstance(beams, SequenceGenerator)
    assert (beams.options.beams, beams.options.n, beams.options.max_tokens, beams.options.min_tokens) == (3, 3, 6, 2)
    hypos = task.inference_step(beams, [model], PROMPTS)
    same = SequenceGenerator([model], task.target_dictionary, GenerationOptions(
        temperature=0, n=3, best_of=3, max_tokens=6, min_tokens=2)).generate([model], PROMPTS)
    assert [[h["tokens"].tolist() for h in row] for row in hypos] == [[h["tokens"].tolist() for h in row] for row in same]
    assert all(len(row) == 3 and all(2 <= len(h["tokens"]) <= 6 for h in row) for row in hypos)

    # metaseq's --beam at a temperature above 0: independent samples; the rest of metaseq's defaults
    samples = task.build_generator([model], Namespace(beam=2, sampling=True, sampling_topp=0.9, sampling_topk=5),
                                   extra_gen_cls_kwargs={"seed": 7, "stop": [50]})
    options = samples.options
    assert (options.samples, options.temperature, options.top_p, options.top_k) == (2, 1.0, 0.9, 5)
    assert (options.max_tokens, options.min_tokens, options.seed, options.stop) == (200, 1, 7, (50,))
    first, again = (task.inference_step(samples, [model], PROMPTS) for _ in range(2))
    assert [h["tokens"].tolist() for h in first[0]] == [h["tokens"].tolist() for h in again[0]]  # seeded


def test_build_generator_takes_a_generation_parser_namespace_and_names_bad_flags(lm):
    task, model = lm
    args = parse_args_and_arch(get_generation_parser(), ["--beam", "2", "--temperature", "0", "--max-len-b", "4"])
    generator = task.build_generator([model], args)
    assert (generator.options.beams, generator.options.max_tokens) == (2, 4)
    assert len(task.inference_step(generator, [model], {"net_input": {"src_tokens": torch.tensor(PROMPTS[:1])}})[0]) == 2
    with pytest.raises(UsageError, match="--sampling-topp and --sampling-topk require --sampling"):
        task.build_generator([model], Namespace(sampling_topp=0.5))
    with pytest.raises(UsageError, match=r"need --min-len <= --max-len-b, got --min-len=9, --max-len-b=4"):
        task.build_generator([model], Namespace(min_len=9, max_len_b=4))
    with pytest.raises(UsageError, match="prefix_tokens is not supported"):
        task.inference_step(generator, [model], PROMPTS, prefix_tokens=torch.tensor([[5]]))


def test_tokenizer_and_bpe_are_the_tasks(lm):
    task, _ = lm
    assert task.build_tokenizer(Namespace()) is None and task.build_tokenizer(Namespace(tokenizer=None)) is None
    with pytest.raises(UsageError, match="--tokenizer moses: metaseq_ds has no pre-tokenizers"):
        task.build_tokenizer(Namespace(tokenizer="moses"))
    assert isinstance(task.build_bpe(Namespace(bpe="gpt2")), ByteTokenizer) and task.build_bpe(None) is task.tokenizer
    with pytest.raises(UsageError, match="BaseTask has no tokenizer"):
        BaseTask(cfg=None).build_bpe(Namespace(bpe="gpt2"))


# ---- dictionaries ------------------------------------------------------------------------------


def test_build_dictionary_counts_words_as_fairseq_and_round_trips_through_dict_txt(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("b a c a\n" * 50 + "d c\n" * 30 + "é e\n")
    one = BaseTask.build_dictionary([str(text)], workers=1, padding_factor=1)
    # </s> counted once per line (81 lines), after the count of 1 every special starts with
    assert dict(zip(one.symbols, one.count)) == {"<s>": 1, "<pad>": 1, "</s>": 82, "<unk>": 1, "a": 100, "c": 80,
                                                  "b": 50, "d": 30, "e": 1, "é": 1}
    assert one.symbols[4:] == ["a", "c", "b", "d", "e", "é"]  # most frequent first, ties in symbol order
    two = BaseTask.build_dictionary([str(text)], workers=2, padding_factor=1)
    assert (two.symbols, two.count) == (one.symbols, one.count)
    small = BaseTask.build_dictionary([str(text), str(text)], threshold=60, nwords=7, padding_factor=8)
    assert small.symbols == ["<s>", "<pad>", "</s>", "<unk>", "a", "c", "b", "madeupword0000"]

    one.save(tmp_path / "dict.txt")
    assert (tmp_path / "dict.txt").read_text().splitlines()[:2] == ["a 100", "c 80"]
    loaded = BaseTask.load_dictionary(str(tmp_path / "dict.txt"))
    assert (loaded.symbols, loaded.count[4:]) == (one.symbols, one.count[4:])  # the specials' counts are not saved


def test_load_dictionary_reads_fairseq_files_and_names_bad_lines(tmp_path):
    good = tmp_path / "dict.txt"
    good.write_text("hello 5\nworld 3\nhello 9 #fairseq:overwrite\n")
    d = BaseTask.load_dictionary(str(good))
    assert d.index("world") == 5 and d.index("hello") == 6 and d.count[6] == 9
    (tmp_path / "dup.txt").write_text("hello 5\nhello 3\n")
    with pytest.raises(UsageError, match=r"dup.txt: line 2: duplicate symbol 'hello'"):
        BaseTask.load_dictionary(str(tmp_path / "dup.txt"))
    (tmp_path / "bad.txt").write_text("hello\n")
    with pytest.raises(UsageError, match=r"bad.txt: line 1: expected '<symbol> <count>"):
        BaseTask.load_dictionary(str(tmp_path / "bad.txt"))


# ---- sizes and data ----------------------------------------------------------------------------


class Lengths(BaseDataset):
    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def size(self, index):
        return self.sizes[index]


def test_filter_indices_by_size_raises_or_skips_too_long_items(caplog):
    task, dataset = BaseTask(cfg=None), Lengths([5, 12, 8, 30])
    indices = np.arange(4)
    assert task.filter_indices_by_size(indices, dataset, max_positions=None).tolist() == [0, 1, 2, 3]
    assert task.filter_indices_by_size(indices, dataset, max_positions=30).tolist() == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="sample #1 has size 12, more than max_positions=10"):
        task.filter_indices_by_size(indices, dataset, max_positions=10)
    kept = task.filter_indices_by_size(np.array([3, 2, 1]), dataset, max_positions=10, ignore_invalid_inputs=True)
    assert kept.tolist() == [2] and "2 samples are longer than max_positions=10" in caplog.text


def test_has_sharded_data_means_several_data_directories():
    assert BaseTask(Namespace(data="/a:/b")).has_sharded_data("train")
    assert not BaseTask(Namespace(data="/a")).has_sharded_data("train")
    assert not BaseTask(Namespace()).has_sharded_data("train")
    assert not BaseTask(StreamingLanguageModelingConfig()).has_sharded_data("train")
