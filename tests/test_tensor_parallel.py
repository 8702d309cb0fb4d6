"""Tensor parallelism: the plan's numerics on 2 ranks, loss curves of real `mseq train` runs
(TP=2, TP=2 x DP=2 x ZeRO-3 on 4 ranks) against one process, resharding TP <-> TP=1 with the
optimizer state (the resumed updates are the unbroken run's), export of a TP checkpoint, and
configuration errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import TINY, env, losses, run, run_worker, write_corpus
from metaseq_ds.distributed.tensor_parallel import merge_shards, partition_dim, partition_dims
from metaseq_ds.errors import UsageError

# Four heads (TINY's arch has one), no dropout: dropout masks are drawn per rank, so curves of
# different layouts agree only without it. 272 = the byte vocabulary padded to a multiple of 16.
TP_TINY = [*TINY, "--decoder-attention-heads", "4", "--dropout", "0", "--attention-dropout", "0",
           "--disable-validation"]
SAME_VOCAB_AT_TP1 = ["--padding-factor", "16"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_plan_partition_dims_and_merge_invert_the_split():
    assert partition_dim("decoder.layers.3.self_attn.q_proj.weight") == 0
    assert partition_dim("decoder.layers.3.self_attn.q_proj.bias") == 0
    assert partition_dim("decoder.layers.0.fc2.weight") == 1
    assert partition_dim("decoder.layers.0.fc2.bias") is None  # row-parallel bias: replicated
    assert partition_dim("decoder.embed_tokens.weight") == 0
    assert partition_dim("decoder.layers.0.self_attn_layer_norm.weight") is None
    embed = torch.randn(16, 4)
    full = {"decoder.embed_tokens.weight": embed, "decoder.output_projection.weight": embed,
            "decoder.layers.0.fc2.weight": torch.randn(4, 8), "decoder.layers.0.fc2.bias": torch.randn(4)}
    shards = [{name: value if (dim := partition_dim(name)) is None else value.chunk(2, dim)[rank]
               for name, value in full.items()} for rank in range(2)]
    for shard in shards:  # a tied pair is one tensor in each rank's state dict
        shard["decoder.output_projection.weight"] = shard["decoder.embed_tokens.weight"]
    merged = merge_shards(shards, partition_dims(full))
    for name, value in full.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=0)
    assert merged["decoder.output_projection.weight"] is merged["decoder.embed_tokens.weight"]


def test_tp2_logits_loss_and_gradients_equal_the_unsharded_model():
    """tp_parity_worker.py: the fused loss over the vocabulary shards, in chunks of 7 rows (of the
    model's 48 and the head's 20, pads among them), against the logits' cross entropy, with the
    embedding tied and untied."""
    diffs = run_worker(Path(__file__).with_name("tp_parity_worker.py"), "TP_PARITY")
    for tied in ("[tied]", "[untied]"):
        assert diffs["sharded_q_proj_rows" + tied] == 16  # half of the 32 rows: the plan did shard
        assert diffs["saved_weight_views" + tied] == 0  # ZeRO-3 can free every TP layer's gathered weight after its forward
        assert diffs["logits" + tied] < 1e-5 and diffs["logit_shard" + tied] < 1e-5
        # The head alone: its loss against its own gathered logits' cross entropy
        assert diffs["head_weight_shard_rows" + tied] == 24  # of the 48 words
        for what in ("loss", "losses", "features_grad", "weight_shard_grad"):
            assert diffs[f"head_{what}{tied}"] < 1e-6, what
        assert diffs["head_pad_losses" + tied] == 0 and diffs["head_losses_equal_across_tp_ranks" + tied]
        # The model through each criterion: its fused loss against its own logits path
        for criterion in ("cross_entropy", "vocab_parallel_cross_entropy"):
            assert diffs[f"logits_like_saved[{criterion}]{tied}"] == 0  # no logits made, whole or sharded
            assert diffs[f"logits_like_saved_by_logits_path[{criterion}]{tied}"] > 0  # which the count would see
            for what in ("loss", "logged_loss", "grad"):
                assert diffs[f"{what}[{criterion}]{tied}"] < 1e-6, (what, criterion)
            assert diffs[f"unsharded_loss[{criterion}]{tied}"] < 1e-6
            assert diffs[f"unsharded_grad[{criterion}]{tied}"] < 1e-6
    # Megatron's rule: replicated activations see the same masks on both ranks, shards different ones.
    assert diffs["replicated_logits_equal_across_tp_ranks"]
    assert diffs["ffn_dropout_masks_differ_across_tp_ranks"]


def _relative_gap(reference, other):
    assert sorted(other) == sorted(reference)
    return max(abs(other[step] - loss) / loss for step, loss in reference.items())


def test_tp2_training_follows_the_tp1_loss_curve_with_either_criterion(corpus):
    common = [str(corpus), *TP_TINY, "--max-update", "20", "--batch-size", "4", "--no-save"]
    tp1 = losses(run(common + SAME_VOCAB_AT_TP1).stdout)
    tp2 = run(common + ["--model-parallel-size", "2"], launcher="deepspeed").stdout
    assert "= 1 data-parallel x 2 tensor-parallel" in tp2
    # Activation checkpointing on top of the plan: recomputation must give the same gradients.
    tp2_vocab_parallel = losses(run(common + ["--model-parallel-size", "2", "--criterion", "vocab_parallel_cross_entropy",
                                              "--checkpoint-activations"], launcher="deepspeed").stdout)
    assert len(tp1) == 20
    assert _relative_gap(tp1, losses(tp2)) <= 1e-4
    assert _relative_gap(tp1, tp2_vocab_parallel) <= 1e-4


def test_tp2_dp2_zero3_on_4_ranks_follows_one_rank_then_resumes_resharded_at_tp1_and_exports(corpus, tmp_path):
    common = [str(corpus), *TP_TINY]
    one_rank = losses(run(common + SAME_VOCAB_AT_TP1 + ["--batch-size", "8", "--max-update", "6",
                                                         "--save-dir", str(tmp_path / "one")]).stdout)
    save_dir = tmp_path / "grid"
    grid = run(common + ["--model-parallel-size", "2", "--zero-stage", "3", "--batch-size", "4", "--max-update", "3",
                         "--save-dir", str(save_dir)], launcher="deepspeed", ranks=4)
    assert "= 2 data-parallel x 2 tensor-parallel" in grid.stdout
    assert _relative_gap({k: v for k, v in one_rank.items() if k <= 3}, losses(grid.stdout)) <= 1e-4
    meta = json.loads(next(save_dir.glob("checkpoint_1_3")).joinpath("metaseq_ds.json").read_text())
    assert meta["tensor_parallel_size"] == 2
    assert meta["partition_dims"]["decoder.layers.0.fc2.weight"] == 1

    exported = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "export", "hf", str(save_dir), str(exported)],
                   check=True, capture_output=True, env=env())
    # Offline to one rank (`mseq reshard`), then updates 4-6 are the one-rank run's: Adam's moments
    # and step crossed the change of tensor-parallel degree, ZeRO stage and rank count.
    one_rank_ckpt = tmp_path / "for_one_rank"
    subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "reshard", str(save_dir), str(one_rank_ckpt),
                    "--ranks", "1", "--zero-stage", "0"], check=True, capture_output=True, env=env())
    resumed = run(common + ["--batch-size", "8", "--max-update", "6", "--save-dir", str(one_rank_ckpt)])
    assert "saved by 4 rank(s) (tensor-parallel 2) with ZeRO-3, now 1 rank(s) with ZeRO-0" in resumed.stderr + resumed.stdout
    assert _relative_gap({k: v for k, v in one_rank.items() if k >= 4}, losses(resumed.stdout)) <= 1e-5

    from transformers import OPTForCausalLM

    from metaseq_ds.checkpoint.inference import load_model_for_inference

    hf = OPTForCausalLM.from_pretrained(exported).eval()
    _, _, ours, _ = load_model_for_inference(str(save_dir / "checkpoint_1_3"), need_data=False)
    tokens = torch.randint(4, 260, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens)[0], rtol=0, atol=1e-5)


def test_tp1_checkpoint_resumes_at_tp2_as_an_unbroken_run_and_zero_stages_1_2_train(corpus, tmp_path):
    common = [str(corpus), *TP_TINY, "--batch-size", "4"]
    reference = losses(run(common + SAME_VOCAB_AT_TP1 + ["--max-update", "6", "--save-interval-updates", "3",
                                                          "--save-dir", str(tmp_path / "a")]).stdout)
    (tmp_path / "a" / "checkpoint_last").write_text("checkpoint_1_3\n")  # resume from update 3 of that run
    resumed = run(common + ["--model-parallel-size", "2", "--zero-stage", "3", "--max-update", "6",
                            "--save-dir", str(tmp_path / "a")], launcher="deepspeed")
    assert "now 2 rank(s) (tensor-parallel 2) with ZeRO-3): weights, fp32 master weights, Adam moments and step 3" \
        in resumed.stdout + resumed.stderr
    assert _relative_gap({k: v for k, v in reference.items() if k >= 4}, losses(resumed.stdout)) <= 1e-5
    for stage in ("1", "2"):
        sharded = run(common + ["--model-parallel-size", "2", "--zero-stage", stage, "--max-update", "4", "--no-save"],
                      launcher="deepspeed")
        assert _relative_gap({k: v for k, v in reference.items() if k <= 4}, losses(sharded.stdout)) <= 1e-4, stage


def test_more_tensor_parallel_ranks_than_launched_is_one_line_before_any_model(corpus, tmp_path):
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "train", str(corpus), *TP_TINY,
                             "--model-parallel-size", "2", "--save-dir", str(tmp_path / "ckpt")],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mseq train: error: --model-parallel-size 2 exceeds the 1 rank(s) the launcher started "
        "(start at least 2, e.g. deepspeed --num_gpus 2)"]
    assert not (tmp_path / "ckpt").exists()


def test_a_deepspeed_preset_cannot_ask_for_its_own_tensor_parallelism(tmp_path):
    from metaseq_ds.distributed.deepspeed_config import build_deepspeed_config
    from metaseq_ds.options import parse_train_config

    preset = tmp_path / "tp.json"
    preset.write_text(json.dumps({"tensor_parallel": {"autotp_size": 4}}))
    cfg = parse_train_config(["/data", "--decoder-attention-heads", "4", "--model-parallel-size", "2",
                              "--deepspeed-config", str(preset)])
    with pytest.raises(UsageError, match="sets tensor_parallel.autotp_size=4; set --model-parallel-size instead"):
        build_deepspeed_config(cfg, world_size=2, fp16_supported=False, overlaps_communication=False)
    plain = parse_train_config(["/data", "--decoder-attention-heads", "4", "--model-parallel-size", "2"])
    derived = build_deepspeed_config(plain, world_size=4, fp16_supported=False, overlaps_communication=False)
    assert derived["tensor_parallel"] == {"autotp_size": 2} and derived["train_batch_size"] == 2 * 8
