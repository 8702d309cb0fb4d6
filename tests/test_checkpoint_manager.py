"""The checkpoint manager's plan: what a run resumes from, decided before any model is built,
and the config it settles. (Restoring and saving run in the `mseq train` tests: test_train,
test_tensor_parallel, test_import.)"""

import dataclasses

import pytest
import torch

from convert_helpers import TINY_MODEL, build_model
from metaseq_ds.checkpoint.files import write_module_checkpoint
from metaseq_ds.checkpoint.layout import Layout
from metaseq_ds.checkpoint.manager import CheckpointManager, ResumeKind
from metaseq_ds.distributed.materialize import materialize
from metaseq_ds.errors import UsageError
from metaseq_ds.options import parse_train_config


def config(*flags, save_dir):
    return parse_train_config(["/data", *TINY_MODEL, "--save-dir", str(save_dir), *flags])


def save_run(save_dir, cfg, world_size=1, zero_stage=0, tp=1, updates=5):
    """What a save of `cfg` by that layout leaves for the plan (rank 0's client state in its file)."""
    model = build_model(cfg.model)
    meta = {"config": cfg.to_dict(), "world_size": world_size, "zero_stage": zero_stage, "num_updates": updates}
    if tp > 1:
        meta["tensor_parallel_size"] = tp
    ref = write_module_checkpoint(save_dir, f"checkpoint_1_{updates}", model.state_dict(), meta)
    client = {"num_updates": updates, "lr_scheduler": {}, "metrics": {}, "rng": {}, "iterator": {"epoch": 1, "iterations_in_epoch": 7}}
    states_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    torch.save({"module": model.state_dict(), **client}, ref.path / states_file)
    return model


def test_an_empty_save_dir_means_a_fresh_start(tmp_path):
    cfg = config(save_dir=tmp_path / "ckpt")
    plan = CheckpointManager(cfg, Layout(1, 0, 1)).plan()
    assert plan.kind is ResumeKind.FRESH


def test_the_same_layout_resumes_exactly_and_another_reshards(tmp_path):
    cfg = config(save_dir=tmp_path)
    save_run(tmp_path, cfg, world_size=2, zero_stage=0)
    assert CheckpointManager(cfg, Layout(1, 0, 1)).plan().kind is ResumeKind.EXACT  # ZeRO-0: any rank count
    plan = CheckpointManager(cfg, Layout(2, 3, 1)).plan()
    assert plan.kind is ResumeKind.RESHARD
    assert plan.saved_layout == Layout(2, 0, 1) and plan.saved_global_batch == 2 * cfg.dataset.batch_size
    assert plan.client_state["num_updates"] == 5 and plan.client_state["iterator"]["iterations_in_epoch"] == 7
    model = build_model(cfg.model, seed=123)
    materialize(model, CheckpointManager(cfg, Layout(2, 3, 1)).parameter_values(plan, model))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), build_model(cfg.model).state_dict().values()))


def test_imported_weights_start_at_update_zero(tmp_path):
    cfg = config(save_dir=tmp_path / "run")
    save_run(tmp_path / "imported", cfg)
    meta_path = next((tmp_path / "imported").glob("checkpoint_*/metaseq_ds.json"))
    meta_path.write_text(meta_path.read_text().replace('"num_updates"', '"weights_only": true, "num_updates"'))
    plan = CheckpointManager(config("--restore-file", str(tmp_path / "imported"), save_dir=tmp_path / "run"),
                             Layout(1, 0, 1)).plan()
    assert plan.kind is ResumeKind.WEIGHTS and plan.client_state is None


def test_no_save_never_reads_the_save_dir_but_an_explicit_restore_file_is_restored(tmp_path):
    other = parse_train_config(["/data", "--arch", "transformer_lm_gpt2_tiny", "--save-dir", str(tmp_path)])
    save_run(tmp_path, other)  # --save-dir holds another model's checkpoint
    with pytest.raises(UsageError, match="holds a checkpoint of another model"):
        CheckpointManager(config(save_dir=tmp_path), Layout(1, 0, 1)).plan()
    assert CheckpointManager(config("--no-save", save_dir=tmp_path), Layout(1, 0, 1)).plan().kind is ResumeKind.FRESH
    ours = config(save_dir=tmp_path / "ours")
    save_run(tmp_path / "ours", ours)
    explicit = config("--no-save", "--restore-file", str(tmp_path / "ours"), save_dir=tmp_path)
    assert CheckpointManager(explicit, Layout(1, 0, 1)).plan().kind is ResumeKind.EXACT


def test_a_missing_explicit_restore_file_is_one_line(tmp_path):
    cfg = config("--restore-file", str(tmp_path / "nowhere"), save_dir=tmp_path)
    with pytest.raises(UsageError, match="--restore-file: no checkpoint at"):
        CheckpointManager(cfg, Layout(1, 0, 1)).plan()


def test_the_saved_padded_vocabulary_is_kept_in_a_new_config(tmp_path):
    saved = config("--padding-factor", "16", save_dir=tmp_path)
    save_run(tmp_path, saved, world_size=2, zero_stage=3, tp=2)
    cfg = config(save_dir=tmp_path)
    manager = CheckpointManager(cfg, Layout(1, 0, 1))
    plan = manager.plan()
    resolved = manager.resolve_config(plan)
    assert plan.kind is ResumeKind.RESHARD
    assert resolved.task.padding_factor == 16 and cfg.task.padding_factor == 8  # a new config; the old unchanged
    assert manager.cfg is resolved  # what its saves record


def test_a_validated_config_is_read_only():
    cfg = parse_train_config(["/data", *TINY_MODEL])
    with pytest.raises(AttributeError, match="read-only once validated"):
        cfg.task.data = "/elsewhere"
    with pytest.raises(AttributeError, match="read-only once validated"):
        cfg.optimization.lr = 1.0
    with pytest.raises(AttributeError, match="read-only once validated"):
        cfg.task = None
    changed = dataclasses.replace(cfg.optimization, lr=1.0)  # deriving a new one is how values change
    assert changed.lr == 1.0 and cfg.optimization.lr != 1.0


def test_the_demo_run_is_decided_once_at_parse_time():
    from metaseq_ds.options import DEMO_DATA_DIR, RunContext, resolve

    demo = parse_train_config([])
    assert demo.dataset.demo and demo.optimization.max_update == 600
    assert resolve(demo, RunContext()).task.data == DEMO_DATA_DIR  # where `mseq train` builds the corpus
    assert demo.model.decoder_embed_dim == 128  # the demo's model, as no --arch was given
    assert parse_train_config(["--demo", "-a", "transformer_lm_gpt2_tiny"]).model.decoder_embed_dim == 64
    data = parse_train_config(["/data"])
    assert not data.dataset.demo and data.task.data == "/data"
    with pytest.raises(UsageError, match="give DATA .* or --demo, not both"):
        parse_train_config(["/data", "--demo"])


def test_the_data_position_moves_in_samples_to_any_split_that_divides_it(tmp_path):
    saved = config("--batch-size", "4", save_dir=tmp_path)
    save_run(tmp_path, saved, world_size=2, zero_stage=0)  # 7 micro-batches of 2 x 4 read: 56 samples

    def position(flags, layout):
        manager = CheckpointManager(config(*flags, save_dir=tmp_path), layout)
        return manager._data_position(manager.plan())["iterations_in_epoch"]

    assert position(["--batch-size", "8"], Layout(1, 3, 1)) == 7
    assert position(["--batch-size", "4", "--update-freq", "2"], Layout(1, 3, 1)) == 14
    assert position(["--batch-size", "2"], Layout(4, 3, 1)) == 7
    with pytest.raises(UsageError, match=r"--batch-size 16 x 1 data-parallel rank\(s\) = 16 samples per micro-batch does "
                                         r"not divide the 56 samples .* or give --reset-dataloader"):
        CheckpointManager(config("--batch-size", "16", save_dir=tmp_path), Layout(1, 3, 1)).plan()
    reset = config("--batch-size", "16", "--reset-dataloader", save_dir=tmp_path)
    assert CheckpointManager(reset, Layout(1, 3, 1)).plan().kind is ResumeKind.RESHARD


def test_another_precision_is_another_layout(tmp_path):
    cfg = config(save_dir=tmp_path)
    save_run(tmp_path, cfg, world_size=1, zero_stage=0)
    assert CheckpointManager(cfg, Layout(1, 0, 1, "bf16")).plan().kind is ResumeKind.RESHARD
    assert CheckpointManager(cfg, Layout(1, 0, 1, "fp32")).plan().kind is ResumeKind.EXACT


def test_zero12_optimizer_groups_are_part_of_the_layout(tmp_path):
    """ZeRO-1/2 files are cut by optimizer group: a save with another grouping (or one from before
    groups were recorded: one group) goes through the resharding path, never DeepSpeed's loader."""
    cfg = config("--zero-stage", "1", save_dir=tmp_path)
    run = Layout.of_run(cfg, 2)
    assert run.optimizer_group_limit == 12 * cfg.model.decoder_embed_dim ** 2
    save_run(tmp_path, cfg, world_size=2, zero_stage=1)  # its meta has no optimizer_group_limit
    plan = CheckpointManager(cfg, run).plan()
    assert plan.kind is ResumeKind.RESHARD and plan.saved_layout.optimizer_group_limit == 0
    assert Layout.of_run(config("--zero-stage", "3", save_dir=tmp_path), 2).optimizer_group_limit == 0
