"""ZeRO-3 with a tied embedding (`distributed.tied_embedding`): the weight is never gathered by
ZeRO-3, its lookup and projection read it a chunk at a time, and its gradient, made after the
backward chunk by chunk into its partitions, is plain autograd's; so are the losses; whatever
the chunks, across micro-steps, from one update to the next and in bf16 (2 ranks on gloo)."""

from pathlib import Path

from launch import run_worker


def test_zero3_losses_and_gradients_with_the_streamed_tied_embedding_equal_plain_autograd():
    report = run_worker(Path(__file__).with_name("tied_embedding_worker.py"), "TIED")
    for case in report:
        assert report[case]["weight_held"] == 0, (case, report[case])  # ZeRO-3 never gathered W
    # recomputing, chunks of whole rows (or whole partitions) fuse the loss: no logits; chunks that
    # cut rows make them, as does every chunking without recomputation
    assert {case for case in report if report[case]["fused"]} == {
        "one_row", "three_rows_chunks_of_whole_rows", "whole_rows_2_micro_steps", "bf16_whole_rows"}
    for case in ("one_row", "three_rows_small_chunks", "three_rows_chunks_of_whole_rows", "whole_rows_logits_kept",
                 "small_chunks_logits_kept", "one_row_2_micro_steps", "whole_rows_2_micro_steps"):
        assert report[case]["embedding_grad_norm"] > 1.0  # a gradient worth comparing
        # relative: a loss is a sum over tokens (~175), and the fused loss sums it in another order
        assert report[case]["loss_worst"] < 1e-6, (case, report[case])
        assert report[case]["worst"] < 1e-5, (case, report[case])
    # bf16 (products in bf16, summed in fp32) against fp32 autograd: bf16's error, no more than
    # DeepSpeed's own parameters get (measured 0.7% of the largest element; a lost part: ~100%)
    for case in ("bf16_three_rows_small_chunks", "bf16_whole_rows", "bf16_whole_rows_logits_kept"):
        bf16 = report[case]
        assert bf16["embedding_worst"] < 0.03 * bf16["embedding_grad_max"] and bf16["embedding_worst"] <= bf16["worst"], bf16


def test_chunks_at_707m_on_4_ranks_and_at_opt_175b_on_1024_ranks():
    from metaseq_ds.distributed.tied_embedding import chunk_length

    vocabulary = 50272
    # 707M (width 2048) at TP=2 x DP=2: each rank's partition of W's shard is 25.7M elements; seven
    # chunks of whole rows, the largest 32 MiB gathered (in fp32) where ZeRO-3 gathered 206 MB
    partition = vocabulary // 2 * 2048 // 2
    length = chunk_length(partition, group_size=2)
    assert -(-partition // length) == 7 and length % 2048 == 0 and partition % 2048 == 0
    assert 2 * length * 4 == 32 * 2**20
    # opt_175b (width 12288) at TP=8 x DP=128: a partition is 0.6M elements, below the slice
    # minimum, so W's shard (154 MB in bf16) comes in one chunk, one product
    partition = vocabulary // 8 * 12288 // 128
    assert chunk_length(partition, group_size=128) == partition == 603_264


def test_the_lookup_reads_nothing_from_the_device():
    """Each chunk adds its rows to the tokens in it without finding them first (`nonzero`, a read
    of the device: a host sync per chunk on a GPU); the rows are those of the whole weight."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from metaseq_ds.distributed.tied_embedding import StreamedTiedEmbedding

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default):
                self.ops.append(func)
            return func(*args, **(kwargs or {}))

    weight = torch.randn(10, 4)

    class Chunked:  # what `lookup` reads of a StreamedTiedEmbedding: W in blocks of 4, 4 and 2 rows
        width = 4

        class weight:  # noqa: N801 (ZeRO-3's parameter: its partition's dtype)
            ds_tensor = weight

        @staticmethod
        def _each_weight_block(visit):
            for first in (0, 4, 8):
                visit(first, weight[first:first + 4])

    tokens = torch.tensor([[9, 0, 4], [3, 8, 5]])
    with Reads() as reads:
        rows = StreamedTiedEmbedding.lookup(Chunked, tokens)
    assert reads.ops == [] and torch.equal(rows, weight[tokens])
