"""Device mix-ups, caught on the CPU: a validation pass (`mseq validate` itself), a train step and
decoding with the model on the meta device (`device_check`), where a GPU run has it on `cuda`.
Any CPU tensor that meets the model's tensors fails the test, as it would fail on a GPU; the
device reads each makes are counted (each a host sync on a GPU)."""

import pytest
import torch

from convert_helpers import write_zero0_checkpoint
from device_check import DEVICE, DeviceMixup, MetaDeviceCheck
from launch import TINY, write_corpus
from metaseq_ds import tasks, trainer
from metaseq_ds.cli import validate
from metaseq_ds.device import module_device, to_device
from metaseq_ds.distributed import materialize
from metaseq_ds.optim import build_optimizer
from metaseq_ds.options import parse_train_config
from metaseq_ds.sequence_generator import SequenceGenerator
from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.models.transformer_decoder import note_left_padding

FLAGS = [*TINY, "--batch-size", "4", "--adam-impl", "torch"]
# Sinusoidal positions: a buffer, not a parameter, computed on the CPU as the model is built.
SINUSOIDAL = [*FLAGS, "--arch", "transformer_lm", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
              "--decoder-layers", "2", "--decoder-attention-heads", "4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def on_meta(monkeypatch):
    """Models loaded for inference land on the meta device, as they land on `cuda` on a GPU."""
    monkeypatch.setattr(materialize, "_training_device", lambda: DEVICE)


def first_batch(task, split="train"):
    return next(iter(task.get_batch_iterator(split=split, batch_size=4, seed=1, num_shards=1, shard_id=0,
                                             epoch=1).next_epoch_itr()))


def test_mseq_validate_runs_on_the_models_device(corpus, tmp_path, on_meta, capsys):
    write_zero0_checkpoint(tmp_path / "ckpt", [str(corpus), *SINUSOIDAL])
    with MetaDeviceCheck() as check:
        validate.main(str(tmp_path / "ckpt"), None, None, None, 3)
    assert "valid: loss" in capsys.readouterr().out
    # the split's sums, once (the padding is known from the batches on the CPU: see the train step)
    assert check.host_reads == ["to cpu"]


def test_the_check_catches_a_batch_left_on_the_cpu(corpus):
    cfg = parse_train_config([str(corpus), *FLAGS])
    task = tasks.setup_task(cfg.task)
    with torch.device("meta"):
        model = task.build_model(cfg.model)
    with MetaDeviceCheck(), pytest.raises(DeviceMixup, match="same device"):
        task.valid_step(first_batch(task, "valid"), model.to(DEVICE), task.build_criterion(cfg.criterion))


class _Backward:
    """What `task.train_step` calls (the trainer's `_EngineBackward` without an engine)."""

    def backward(self, loss):
        loss.backward()


def test_a_train_step_runs_on_the_models_device(corpus):
    cfg = parse_train_config([str(corpus), *FLAGS])
    task = tasks.setup_task(cfg.task)
    criterion = task.build_criterion(cfg.criterion)
    model = task.build_model(cfg.model).to(DEVICE)  # as DeepSpeed's engine moves it to its device
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    sample = first_batch(task)
    with MetaDeviceCheck() as check:
        for _ in range(2):  # the second step has optimizer state
            on_device = to_device(note_left_padding(sample, model), module_device(model))  # as the trainer moves it
            _, _, logging_output = task.train_step(on_device, model, criterion, _Backward(), 0)
            norm = trainer._squared_norm([p.grad for p in model.parameters()], module_device(model))
            optimizer.optimizer.step()
            optimizer.optimizer.zero_grad()
    assert logging_output["loss"].device == DEVICE and norm.device == DEVICE
    # no read of the device: the padding is known from the batch on the CPU (metaseq read it every forward)
    assert check.host_reads == []


def test_decoding_runs_on_the_models_device(corpus, tmp_path, on_meta):
    from metaseq_ds.checkpoint.inference import load_model_for_inference

    write_zero0_checkpoint(tmp_path / "ckpt", [str(corpus), *SINUSOIDAL])
    _, task, model, _ = load_model_for_inference(str(tmp_path / "ckpt"), need_data=False)
    assert module_device(model) == DEVICE and all(b.device == DEVICE for b in model.buffers())
    options = GenerationOptions(max_tokens=4, temperature=0.0, logprobs=2)
    generator = SequenceGenerator([model], task.target_dictionary, options)
    with MetaDeviceCheck():
        hypos = generator.generate([model], [[5, 6, 7], [8, 9]])
    assert [len(h[0]["tokens"]) for h in hypos] == [4, 4]


def test_training_reads_the_device_once_per_log_line(corpus, tmp_path, monkeypatch):
    """Each update's loss and gradient norm stay on the device (a read is a host sync on a GPU)
    until the log line, which reads the updates since the last one together."""
    from typer.testing import CliRunner

    from metaseq_ds.cli.main import app
    from metaseq_ds.logging import reduction

    reads = []
    read_values = reduction.read_values

    def counted(stats):
        reads.append([(values["loss"], values["gnorm"]) for values in stats])
        return read_values(stats)

    monkeypatch.setattr(reduction, "read_values", counted)
    result = CliRunner().invoke(app, ["train", str(corpus), *FLAGS, "--log-interval", "3", "--max-update", "6", "--no-save",
                                      "--disable-validation", "--save-dir", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert [len(updates) for updates in reads if updates] == [3, 3]  # at updates 3 and 6
    assert all(torch.is_tensor(loss) and torch.is_tensor(gnorm) for updates in reads for loss, gnorm in updates)
