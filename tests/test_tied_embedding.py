"""ZeRO-3 with a tied embedding: the weight's gradient, made after the backward chunk by chunk
into its partitions (`distributed.tied_embedding`), is plain autograd's, whatever the chunks,
across micro-steps and from one update to the next (2 ranks on gloo)."""

from pathlib import Path

from launch import run_worker


def test_zero3_gradients_with_the_deferred_tied_embedding_gradient_equal_plain_autograd():
    report = run_worker(Path(__file__).with_name("tied_embedding_worker.py"), "TIED")
    for case in ("one_row", "three_rows_small_chunks", "one_row_2_micro_steps"):
        assert report[case]["embedding_grad_norm"] > 1.0  # a gradient worth comparing
        assert report[case]["worst"] < 1e-5, (case, report[case])
