"""`mseq export hf`: exported folders load in transformers and compute our logits.

Tiny random models of each OPT variant, written as ZeRO-0 checkpoints in-process; one real
2-rank ZeRO-3 run (slow) checks that sharded checkpoints export the same model as a 1-rank
run, and that they resume on another number of ranks.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import OPTForCausalLM

from convert_helpers import VARIANTS, model_of_checkpoint, tokens, variant_flags, write_zero0_checkpoint
from launch import TINY, log_records, run, write_corpus
from metaseq_ds.convert.hf_export import export_hf


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_model_gives_our_logits(variant, tmp_path):
    ours, _ = write_zero0_checkpoint(tmp_path / "ckpt", variant_flags(variant))
    notes = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = OPTForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    with torch.no_grad():
        diff = (ours(x)[0] - hf(x).logits).abs().max().item()
    assert diff < 1e-5, diff
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["OPTForCausalLM"]
    assert config["do_layer_norm_before"] is (variant != "post_ln_350m_like")
    assert config["word_embed_proj_dim"] == (16 if variant == "post_ln_350m_like" else 32)
    assert config["activation_function"] == ("gelu" if variant == "gelu" else "relu")
    assert (config["max_position_embeddings"], config["pad_token_id"], config["eos_token_id"]) == (16, 1, 2)
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    assert notes == []  # the byte tokenizer is exported too


TEXTS = ["the model reads tokens", "  two  spaces\n\tand tabs", "héllo — 日本語 🙂", "ünïcödé words"]


def test_byte_tokenizer_is_exported_as_a_tokenizer_giving_our_ids(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from metaseq_ds.data.tokenizers import ByteTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_zero0_checkpoint(tmp_path / "ckpt", variant_flags("pre_ln"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    tokenizer, ours = AutoTokenizer.from_pretrained(tmp_path / "hf"), ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text) and tokenizer.decode(ids) == text
    # Bytes that are no UTF-8 character decode as ours do (U+FFFD); no id is left unknown.
    broken = [4 + 0xC3, 4 + 0xC3, 4 + ord("A"), 4 + 0xE6, 4 + 0x97]
    assert tokenizer.decode(broken) == ours.decode(broken) == "\ufffd\ufffdA\ufffd"
    assert len(tokenizer) == ours.vocab_size and tokenizer.convert_ids_to_tokens(4 + 0xFF) != "<unk>"
    # Special tokens as mseq serve's /tokenize and /detokenize read and write them.
    assert tokenizer("a</s>")["input_ids"] == [4 + ord("a"), 2] and tokenizer.decode([2, 4 + ord("a")]) == "</s>a"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == \
        (2, 2, 1, 3)
    assert tokenizer.model_max_length == 16


@pytest.mark.parametrize("dtype, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_dtype_and_sharded_index(dtype, torch_dtype, tmp_path):
    ours, _ = write_zero0_checkpoint(tmp_path / "ckpt", variant_flags("pre_ln"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=dtype, max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and "lm_head.weight" not in index["weight_map"]  # tied: HF ties it itself
    with safe_open(str(tmp_path / "hf" / shards[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch_dtype
    hf = OPTForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    expected = {k: v.to(torch_dtype).float() for k, v in ours.state_dict().items()}
    torch.testing.assert_close(hf.model.decoder.layers[1].fc2.weight, expected["decoder.layers.1.fc2.weight"])


def test_bpe_tokenizer_of_the_run_is_exported(tmp_path, monkeypatch):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    from launch import WORDS
    from metaseq_ds.data.tokenizers import build_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.save_model(str(tmp_path))
    flags = variant_flags("pre_ln") + ["--vocab-filename", str(tmp_path / "vocab.json"),
                                       "--merges-filename", str(tmp_path / "merges.txt")]
    write_zero0_checkpoint(tmp_path / "ckpt", flags)
    assert export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf")) == []
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = build_tokenizer(None, str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text) == bpe.encode(text).ids and tokenizer.decode(ids) == ours.decode(ids) == text
    assert tokenizer("reads</s>")["input_ids"] == ours.encode("reads") + [2]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.model_max_length) == (2, 1, 16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 1-update run saved by 2 ranks with ZeRO-3 and by 1 rank with ZeRO-0."""
    root = tmp_path_factory.mktemp("zero")
    corpus = write_corpus(root / "corpus")
    # A tiny lr: Adam's first step is ~lr * sign(grad), and the two runs' gradients differ in
    # the last bits, so the trained weights may differ by up to 2 * lr where a gradient is ~0.
    common = [str(corpus), *TINY, "--lr", "1e-7", "--max-update", "1", "--dropout", "0",
              "--attention-dropout", "0", "--disable-validation"]
    run(common + ["--batch-size", "2", "--zero-stage", "3", "--save-dir", str(root / "zero3")], launcher="deepspeed")
    run(common + ["--batch-size", "4", "--save-dir", str(root / "single")])
    return root, common


@pytest.mark.slow
def test_zero3_two_rank_export_equals_single_rank_export(runs):
    root, _ = runs
    assert (root / "zero3" / "checkpoint_1_1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    for name in ("zero3", "single"):
        export_hf(str(root / name), str(root / f"hf_{name}"))
    sharded = OPTForCausalLM.from_pretrained(root / "hf_zero3").state_dict()
    single = OPTForCausalLM.from_pretrained(root / "hf_single").state_dict()
    assert sharded.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], atol=1e-6, rtol=0)
    ours, _ = model_of_checkpoint(root / "zero3")
    hf = OPTForCausalLM.from_pretrained(root / "hf_zero3").eval()
    x = tokens()
    with torch.no_grad():
        assert (ours(x)[0] - hf(x).logits).abs().max().item() < 1e-5


@pytest.mark.slow
def test_two_rank_zero3_checkpoint_resumes_on_one_rank(runs):
    root, common = runs
    result = run(common[:-1] + ["--max-update", "2", "--batch-size", "4", "--save-dir", str(root / "zero3")]
                 + ["--disable-validation"])
    assert "resharded" in result.stdout and "Adam moments and step 1" in result.stdout
    assert [r["num_updates"] for r in log_records(result.stdout)] == [2]
