"""`mseq import hf` / `mseq import metaseq` / `--restore-file hf:DIR`: imports compute the source's logits.

metaseq checkpoints are built here from a known model with the documented layout (DESIGN.md):
`decoder.layer_norm`, `decoder.version`, fused `qkv_proj` with rows K, V, Q per part,
column-parallel tensors split on dim 0 and row-parallel weights on dim 1 across
`-model_part-{r}.pt` files.
"""

import argparse
import enum
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from convert_helpers import TINY_MODEL, VOCAB, build_model, model_of_checkpoint, tokens
from launch import TINY, run, write_corpus
from metaseq_ds.convert.hf_import import import_hf
from metaseq_ds.convert.metaseq_import import import_metaseq
from metaseq_ds.errors import UsageError

HF_VARIANTS = {
    "pre_ln": {},
    "post_ln_350m_like": {"do_layer_norm_before": False, "word_embed_proj_dim": 16},
    "gelu": {"activation_function": "gelu"},
}


def random_hf_opt(**changes):
    values = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                  max_position_embeddings=16, word_embed_proj_dim=32, init_std=0.2)
    config = OPTConfig(**{**values, **changes})
    torch.manual_seed(0)
    return OPTForCausalLM(config).eval()


def logits_diff(ours, hf) -> float:
    x = tokens()
    with torch.no_grad():
        return (ours(x)[0] - hf(x).logits).abs().max().item()


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_hf_import_gives_hf_logits(variant, tmp_path):
    hf = random_hf_opt(**HF_VARIANTS[variant])
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours, cfg = model_of_checkpoint(tmp_path / "ours")
    assert logits_diff(ours, hf) < 1e-5
    assert cfg.model.decoder_normalize_before is (variant != "post_ln_350m_like")


def test_hub_layout_without_model_prefix_or_lm_head_imports(tmp_path):
    from safetensors.torch import save_file

    hf = random_hf_opt()
    hf.config.save_pretrained(tmp_path / "hub")
    save_file({k[len("model."):]: v.contiguous() for k, v in hf.state_dict().items() if k.startswith("model.")},
              str(tmp_path / "hub" / "model.safetensors"))
    import_hf(str(tmp_path / "hub"), str(tmp_path / "ours"))
    assert logits_diff(model_of_checkpoint(tmp_path / "ours")[0], hf) < 1e-5


def test_restore_file_hf_checks_flags_and_loads(tmp_path):
    from metaseq_ds.checkpoint.layout import Layout
    from metaseq_ds.checkpoint.manager import CheckpointManager
    from metaseq_ds.convert.hf_import import read_hf_model
    from metaseq_ds.distributed.materialize import materialize
    from metaseq_ds.options import parse_train_config

    def hf_plan(cfg):
        manager = CheckpointManager(cfg, Layout(world_size=1, zero_stage=0, tensor_parallel_size=1),
                                    foreign_formats={"hf": read_hf_model})
        return manager, manager.plan()

    hf = random_hf_opt()
    hf.save_pretrained(tmp_path / "hf")
    cfg = parse_train_config(TINY_MODEL + ["--restore-file", f"hf:{tmp_path / 'hf'}"])
    wrong = parse_train_config(TINY_MODEL[:-4] + ["--tokens-per-sample", "8", "--restore-file", f"hf:{tmp_path / 'hf'}"])
    with pytest.raises(UsageError, match="max_target_positions=16, this run 8 \\(use --max-target-positions 16\\)"):
        hf_plan(wrong)
    model = build_model(cfg.model, seed=5)
    manager, plan = hf_plan(cfg)
    materialize(model, manager.parameter_values(plan, model))
    assert logits_diff(model, hf) < 1e-5


# -- metaseq / fairseq checkpoints built from a known model ------------------------------------

def metaseq_state(model, parts: int, fused: bool):
    """Our model's weights in metaseq's layout, split into `parts` model-parallel parts."""
    from metaseq_ds.convert.key_maps import partition_dim

    theirs = {k.replace("decoder.final_layer_norm.", "decoder.layer_norm."): v for k, v in model.state_dict().items()}
    states = [{"decoder.version": torch.tensor([3.0])} for _ in range(parts)]
    for key, tensor in theirs.items():
        if ".self_attn.q_proj." in key and fused:
            k, v, q = (theirs[key.replace("q_proj", name)] for name in ("k_proj", "v_proj", "q_proj"))
            for r in range(parts):  # within each part: its K rows, then V, then Q
                states[r][key.replace("q_proj", "qkv_proj")] = torch.cat(
                    [t.chunk(parts, dim=0)[r] for t in (k, v, q)], dim=0)
            continue
        if fused and (".self_attn.k_proj." in key or ".self_attn.v_proj." in key):
            continue
        dim = partition_dim(key)
        for r in range(parts):
            states[r][key] = tensor.clone() if dim is None else tensor.chunk(parts, dim=dim)[r].clone()
    return states


def metaseq_cfg(cfg, parts: int):
    model = {k: v for k, v in cfg.model.to_dict().items()}
    model["_name"] = "transformer_lm_megatron"
    return {"model": model, "task": {"tokens_per_sample": 16}, "common": {"model_parallel_size": parts}}


@pytest.fixture(scope="module")
def known():
    from metaseq_ds.options import parse_train_config

    cfg = parse_train_config(TINY_MODEL)
    return build_model(cfg.model, seed=3), cfg


@pytest.mark.parametrize("parts, fused", [(1, False), (1, True), (2, True), (2, False)])
def test_metaseq_singleton_and_model_parallel_parts_import(parts, fused, known, tmp_path):
    model, cfg = known
    for r, state in enumerate(metaseq_state(model, parts, fused)):
        name = "checkpoint.pt" if parts == 1 else f"checkpoint-model_part-{r}.pt"
        torch.save({"model": state, "cfg": metaseq_cfg(cfg, parts), "optimizer_history": [], "extra_state": {},
                    "last_optimizer_state": None}, tmp_path / name)
    source = tmp_path / ("checkpoint.pt" if parts == 1 else "checkpoint-model_part-1.pt")
    import_metaseq(str(source), str(tmp_path / "ours"))
    imported, _ = model_of_checkpoint(tmp_path / "ours")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(imported(x)[0], model(x)[0], atol=0, rtol=0)


class FakeChoice(enum.Enum):  # stands for fairseq's ChoiceEnum values in pickled configs
    GELU = "gelu"


def test_fairseq_gpt_checkpoint_with_pickled_classes_imports_without_importing_them(tmp_path, monkeypatch):
    """fairseq transformer_lm_gpt: sinusoidal positions, scaled embeddings, args Namespace, an enum."""
    from metaseq_ds.options import parse_train_config

    cfg = parse_train_config(["--arch", "transformer_lm", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
                              "--decoder-layers", "2", "--decoder-attention-heads", "4", "--decoder-normalize-before",
                              "--activation-fn", "gelu", "--tokens-per-sample", "16", "--init-std", "0.2"])
    model = build_model(cfg.model, seed=4)
    fake = types.ModuleType("fairseq.dataclass.constants")
    FakeChoice.__module__ = "fairseq.dataclass.constants"
    fake.FakeChoice = FakeChoice
    for name in ("fairseq", "fairseq.dataclass", "fairseq.dataclass.constants"):
        monkeypatch.setitem(sys.modules, name, fake)
    args = argparse.Namespace(arch="transformer_lm_gpt", activation_fn=FakeChoice.GELU, decoder_attention_heads=4,
                              decoder_normalize_before=True, decoder_learned_pos=False, tokens_per_sample=16,
                              share_decoder_input_output_embed=False, no_scale_embedding=False, dropout=0.1)
    state = {k.replace("decoder.final_layer_norm.", "decoder.layer_norm."): v for k, v in model.state_dict().items()}
    state["decoder.embed_positions._float_tensor"] = torch.zeros(1)
    torch.save({"model": state, "args": args, "extra_state": {"best": 1.5}}, tmp_path / "checkpoint_best.pt")
    for name in ("fairseq", "fairseq.dataclass", "fairseq.dataclass.constants"):
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "checkpoint_best.pt", weights_only=True)
    notes = import_metaseq(str(tmp_path / "checkpoint_best.pt"), str(tmp_path / "ours"))
    assert "fairseq" not in sys.modules
    assert any("fairseq.dataclass.constants.FakeChoice" in note for note in notes)
    imported, imported_cfg = model_of_checkpoint(tmp_path / "ours")
    assert imported_cfg.model.activation_fn == "gelu" and not imported_cfg.model.decoder_learned_pos
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(imported(x)[0], model(x)[0], atol=0, rtol=0)


def test_real_omegaconf_cfg_reads_as_plain_data_without_omegaconf():
    """The fixture was written by `torch.save({'cfg': OmegaConf.create(...), ...})` with omegaconf 2.4."""
    from metaseq_ds.convert.restricted_unpickler import load_legacy_checkpoint, plain

    state, stand_ins = load_legacy_checkpoint(Path(__file__).parent / "fixtures" / "omegaconf_cfg.pt")
    assert "omegaconf" not in sys.modules
    assert "omegaconf.dictconfig.DictConfig" in stand_ins
    assert plain(state["cfg"]) == {"model": {"_name": "transformer_lm_gpt", "decoder_layers": 2,
                                             "activation_fn": "relu", "x": None, "lst": [1, 2]},
                                   "task": {"tokens_per_sample": 16}}
    assert plain(state["args"]) == {"arch": "transformer_lm", "a": 1}
    assert float(state["extra"]) == 3.5


@pytest.mark.slow
def test_round_trip_hf_to_ours_train_ten_steps_back_to_hf_generates(tmp_path):
    from metaseq_ds.convert.hf_export import export_hf

    hf = random_hf_opt(max_position_embeddings=32)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    corpus = write_corpus(tmp_path / "corpus")
    flags = TINY_MODEL[:-4] + ["--tokens-per-sample", "32"]
    train_flags = [a for a in TINY if a not in ("--arch", "transformer_lm_gpt2_tiny", "--tokens-per-sample", "32")]
    result = run([str(corpus), *flags, *train_flags, "--max-update", "10", "--batch-size", "4",
                  "--restore-file", str(tmp_path / "imported"), "--save-dir", str(tmp_path / "run"),
                  "--disable-validation"])
    assert "started from the weights of" in result.stdout
    export_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    trained = OPTForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert not torch.equal(trained.model.decoder.layers[0].fc1.weight, hf.model.decoder.layers[0].fc1.weight)
    out = trained.generate(tokens(1, 5), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 11)
