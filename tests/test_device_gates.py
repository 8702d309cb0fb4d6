"""What differs between CPU and GPU ranks, gate by gate: the patches written for CPU ranks are off
where tensors live on a GPU, and GPU ranks pin batches, take their own GPU and run collectives
on it. Each gate is tested with the device a GPU run would have (faked where the code asks torch
whether CUDA is there or which backend runs, the meta device where it looks at a tensor's device)."""

import os

import pytest
import torch

from metaseq_ds import host_memory
from metaseq_ds.device import pin
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.modules.linear import ONEDNN_MIN_ROWS, lay_out_for_decoding, uses_onednn


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_onednn_linear_only_for_cpu_tensors(device):
    x = torch.empty(ONEDNN_MIN_ROWS, 64, device=device)
    weight = torch.empty(2**20 // 64, 64, device=device)
    assert uses_onednn(x, weight) == (device == "cpu" and torch.backends.mkldnn.is_available())


def test_decoding_layout_only_for_cpu_weights():
    model = torch.nn.Linear(8, 4, device="meta")
    before = model.weight.stride()
    lay_out_for_decoding(model)
    assert model.weight.stride() == before


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 0), "meta"])
def test_heap_release_only_on_cpu_ranks(device, monkeypatch):
    trimmed = []
    monkeypatch.setattr(host_memory, "_libc", lambda: type("libc", (), {"malloc_trim": lambda *a: trimmed.append(a)}))
    assert host_memory.release_freed_heap(device) is False and trimmed == []
    assert host_memory.release_freed_heap(torch.device("cpu")) is True and len(trimmed) == 1


@pytest.mark.parametrize("cuda", [False, True])
def test_environment_on_cpu_and_gpu_ranks(cuda, monkeypatch):
    """A GPU rank takes its own GPU (LOCAL_RANK) before anything is made on "cuda" and leaves glibc's
    heap and DeepSpeed's accelerator choice alone; a CPU rank fixes the heap's mmap threshold and tells
    DeepSpeed's CPU accelerator its local rank count (LOCAL_SIZE: no numactl run at each device count)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist_utils, "fix_mmap_threshold", lambda: calls.append("mmap threshold"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "DS_ACCELERATOR"):
        monkeypatch.setenv(name, "")  # recorded, so that what prepare_environment sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    dist_utils.prepare_environment()
    if cuda:
        assert calls == [("set_device", 0)] and "DS_ACCELERATOR" not in os.environ and "LOCAL_SIZE" not in os.environ
    else:
        assert calls == ["mmap threshold"] and os.environ["DS_ACCELERATOR"] == "cpu" and os.environ["LOCAL_SIZE"] == "1"


@pytest.mark.parametrize("backend, expected", [("gloo", "cpu"), ("nccl", "cuda:0")])
def test_collectives_take_tensors_on_the_backends_device(backend, expected, monkeypatch):
    monkeypatch.setattr(dist_utils.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert str(dist_utils.collective_device()) == expected


@pytest.mark.parametrize("cuda", [False, True])
def test_batches_are_pinned_only_for_a_gpu(cuda, monkeypatch):
    pinned = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned.append(tensor.shape) or tensor)
    sample = {"net_input": {"src_tokens": torch.zeros(2, 3)}, "target": torch.zeros(2, 3), "ntokens": 6}
    result = pin(sample)
    if cuda:
        assert pinned == [torch.Size([2, 3])] * 2 and result["ntokens"] == 6
    else:
        assert result is sample and pinned == []
