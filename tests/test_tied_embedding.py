"""ZeRO-3 with a tied embedding: the embedding's gradient, added into the weight's gradient
partition after the backward (`distributed.tied_embedding`), gives exactly plain autograd's
gradients, whichever way its rows travel and across micro-steps (2 ranks on gloo)."""

from pathlib import Path

from launch import run_worker


def test_zero3_gradients_with_the_deferred_tied_embedding_gradient_equal_plain_autograd():
    report = run_worker(Path(__file__).with_name("tied_embedding_worker.py"), "TIED")
    assert report["one_row"]["exchange"] == "rows" and report["three_rows"]["exchange"] == "dense"
    for case in ("one_row", "three_rows", "one_row_2_micro_steps"):
        assert report[case]["embedding_grad_norm"] > 1.0  # a gradient worth comparing
        assert report[case]["worst"] < 1e-5, (case, report[case])
