"""Which checkpoint resumes: the pointer decides, so a save cut short never does."""

import pytest

from metaseq_ds.checkpoint import files
from metaseq_ds.checkpoint.files import CheckpointRef, find_checkpoint, mark_last, remove_old_checkpoints, write_meta
from metaseq_ds.errors import UsageError


def _save(save_dir, tag, last=True):
    ref = CheckpointRef(save_dir, tag)
    ref.path.mkdir(parents=True)
    write_meta(ref, {"config": {"arch": "a", "model": {}}, "num_updates": int(tag.rsplit("_", 1)[1])})
    if last:
        mark_last(ref)
    return ref


def test_a_save_cut_short_is_never_resumed(tmp_path):
    _save(tmp_path, "checkpoint_1_4")
    (tmp_path / "checkpoint_1_8").mkdir()  # a crash left shards but no meta and no pointer update
    (tmp_path / "checkpoint_1_8" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    ref = find_checkpoint("checkpoint_last", str(tmp_path))
    assert ref.tag == "checkpoint_1_4"
    assert not list(tmp_path.glob("*.tmp"))


def test_restore_file_forms(tmp_path):
    _save(tmp_path, "checkpoint_1_2")
    _save(tmp_path, "checkpoint_1_4")
    assert find_checkpoint("checkpoint_1_2", str(tmp_path)).tag == "checkpoint_1_2"
    assert find_checkpoint(str(tmp_path)).tag == "checkpoint_1_4"  # a save dir means its last
    assert find_checkpoint(str(tmp_path / "checkpoint_1_2")).tag == "checkpoint_1_2"
    assert find_checkpoint("checkpoint_last", str(tmp_path / "empty")) is None


def test_keep_last_updates_prunes_oldest_by_update_count(tmp_path):
    for updates in (2, 10, 4):
        _save(tmp_path, f"checkpoint_1_{updates}")
    remove_old_checkpoints(tmp_path, keep_last=2, current="checkpoint_1_4")
    assert sorted(p.name for p in tmp_path.glob("checkpoint_1_*")) == ["checkpoint_1_10", "checkpoint_1_4"]


def test_unreadable_meta_is_a_usage_error(tmp_path):
    (tmp_path / "checkpoint_1_1").mkdir()
    (tmp_path / "checkpoint_1_1" / "metaseq_ds.json").write_text("{trunc")
    with pytest.raises(UsageError, match="not a metaseq_ds checkpoint"):
        CheckpointRef(tmp_path, "checkpoint_1_1").meta()


def test_another_architecture_is_refused_naming_the_difference(tmp_path):
    meta = {"config": {"arch": "opt_125m", "model": {"decoder_layers": 12, "dropout": 0.1}}}
    with pytest.raises(UsageError, match="--arch opt_125m"):
        files.check_compatible(meta, "opt_350m", {"decoder_layers": 12, "dropout": 0.1}, tmp_path)
    with pytest.raises(UsageError, match="decoder_layers=12 \\(now 2\\)"):
        files.check_compatible(meta, "opt_125m", {"decoder_layers": 2, "dropout": 0.1}, tmp_path)
    files.check_compatible(meta, "opt_125m", {"decoder_layers": 12, "dropout": 0.0}, tmp_path)


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_weights_read_from_a_mapped_checkpoint_own_their_memory_and_leave_no_pages_behind(tmp_path):
    import torch

    from metaseq_ds.checkpoint.values import CheckpointValues, file_mapped

    generator = torch.Generator().manual_seed(0)
    weights = {"row_parallel": torch.randn(2048, 2048, generator=generator),  # 16 MiB each
               "replicated": torch.randn(2048, 2048, generator=generator)}
    torch.save(weights, tmp_path / "weights.pt")
    mapped = torch.load(tmp_path / "weights.pt", mmap=True, weights_only=True)
    assert file_mapped(mapped["replicated"]) and not file_mapped(weights["replicated"])
    values = CheckpointValues(mapped, "test", initial=None)
    before = _resident_kib()
    part = values.shard("row_parallel", (2048, 2048), dim=1, rank=1, size=2)  # reads every page of the tensor
    whole = values.shard("replicated", (2048, 2048), dim=None, rank=0, size=1)
    grown = _resident_kib() - before
    assert torch.equal(part, weights["row_parallel"][:, 1024:]) and torch.equal(whole, weights["replicated"])
    assert not file_mapped(part) and not file_mapped(whole)  # a parameter never pins the file's pages
    assert grown < (24 + 8) * 1024  # the two parts (8 + 16 MiB), not also the 32 MiB of pages read
    assert torch.equal(mapped["row_parallel"], weights["row_parallel"])  # released pages read again from the file
