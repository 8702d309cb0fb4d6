"""lm-evaluation-harness against `mseq serve`: its `local-completions` model, finding the tokenizer
through the server's vLLM-style routes, scores a tiny random checkpoint as its `hf` model scores
the `mseq export` of it: the same loglikelihood per sample (multiple choice, rolling), the same
accuracy, the same greedy generations. Local task files and data: nothing is downloaded."""

import json

import pytest

from convert_helpers import TINY_MODEL, write_zero0_checkpoint
from serving import API_KEY, server_thread

POSITIONS = 256
MAX_GEN_TOKS = 12
BPE_VOCAB = 304  # 300 ids of a BPE trained here, padded to a multiple of 8 as the task pads it

MULTIPLE_CHOICE = [
    {"question": "the model reads", "choices": ["tokens", "weights", "nothing at all"], "answer": 0},
    {"question": "gradients flow through the", "choices": ["layer", "data", "shards"], "answer": 1},
    {"question": "perplexity of the batch", "choices": ["is low", "is high"], "answer": 0},
    {"question": "attention over ränks — ünicode", "choices": ["yes", "nö", "日本"], "answer": 2},
]
DOCUMENTS = [
    {"text": "the optimizer updates weights while the data loader reads the next batch"},
    {"text": "héllo wörld: loss 3.75 bits per byte, 日本語 too"},
    {"text": "short"},
]
PROMPTS = [
    {"prompt": "the model reads tokens and", "target": " predicts"},
    {"prompt": "Question: what is the loss?\nAnswer:", "target": " low"},
    {"prompt": "ünïcödé", "target": "x"},
]

TASKS = {
    "mseq_mc": (MULTIPLE_CHOICE, """
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""),
    "mseq_rolling": (DOCUMENTS, """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
    "mseq_generate": (PROMPTS, f"""
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
metric_list:
  - metric: exact_match
"""),
}


def write_tasks(folder):
    folder.mkdir()
    for name, (rows, body) in TASKS.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
            f"test_split: test\n{body}")
    return folder


def bpe_files(folder):
    """A GPT-2 style byte BPE trained offline on a few words, OPT's specials at ids 0-3."""
    from tokenizers import ByteLevelBPETokenizer

    from launch import WORDS

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, vocab_size=BPE_VOCAB - 4, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    folder.mkdir()
    bpe.save_model(str(folder))
    return ["--vocab-filename", str(folder / "vocab.json"), "--merges-filename", str(folder / "merges.txt")]


def evaluate(model: str, model_args: dict, tasks_folder):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=sorted(TASKS), batch_size=1, log_samples=True,
        task_manager=TaskManager(include_path=str(tasks_folder), include_defaults=False))


def per_sample(results, task):
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_local_completions_against_mseq_serve_scores_as_hf_scores_the_export(tokenizer, tmp_path, monkeypatch):
    from metaseq_ds.convert.hf_export import export_hf
    from metaseq_ds.hub_utils import GeneratorInterface

    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer key
    flags = [flag if flag != "16" else str(POSITIONS) for flag in TINY_MODEL]
    if tokenizer == "bpe":
        write_zero0_checkpoint(tmp_path / "ckpt", flags + bpe_files(tmp_path / "bpe"), vocab=BPE_VOCAB)
    else:
        write_zero0_checkpoint(tmp_path / "ckpt", flags)
    assert export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf")) == []
    tasks = write_tasks(tmp_path / "tasks")
    interface = GeneratorInterface(str(tmp_path / "ckpt"))
    interface.load_model()
    with server_thread(interface) as server:
        served = evaluate("local-completions", {
            "base_url": f"{server.url}/v1/completions", "model": "tiny", "tokenizer_backend": "auto",
            "auth_token": API_KEY, "max_length": POSITIONS, "max_gen_toks": MAX_GEN_TOKS}, tasks)
    assert served["config"]["model"] == "local-completions"
    exported = evaluate("hf", {"pretrained": str(tmp_path / "hf"), "dtype": "float32", "device": "cpu"}, tasks)

    mine, theirs = per_sample(served, "mseq_mc"), per_sample(exported, "mseq_mc")
    assert [len(choices) for choices in mine] == [len(row["choices"]) for row in MULTIPLE_CHOICE]
    for served_choices, hf_choices in zip(mine, theirs):
        assert [ll for [(ll, _)] in served_choices] == pytest.approx([ll for [(ll, _)] in hf_choices], abs=1e-4)
    assert served["results"]["mseq_mc"]["acc,none"] == exported["results"]["mseq_mc"]["acc,none"]

    mine, theirs = per_sample(served, "mseq_rolling"), per_sample(exported, "mseq_rolling")
    assert [ll for [[ll]] in mine] == pytest.approx([ll for [[ll]] in theirs], abs=1e-3)
    assert all(ll < 0 for [[ll]] in mine)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert served["results"]["mseq_rolling"][metric] == \
            pytest.approx(exported["results"]["mseq_rolling"][metric], rel=1e-4)

    generations = per_sample(served, "mseq_generate")
    assert generations == per_sample(exported, "mseq_generate")
    assert any(text for [[text]] in generations)  # not all empty: the comparison has text to compare
