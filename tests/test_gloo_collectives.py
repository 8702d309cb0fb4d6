"""gloo's all-gather and reduce-scatter without a second copy of their data
(`distributed.gloo_collectives`): torch's results on 3 ranks and on a group of two, and
DeepSpeed's collectives routed to them by `utils.init_distributed`."""

from pathlib import Path

from launch import run_worker


def test_in_place_gloo_collectives_equal_torchs_and_deepspeed_reaches_them():
    report = run_worker(Path(__file__).with_name("gloo_collectives_worker.py"), "GLOO", ranks=3)
    assert report.pop("routing") == {"routed": True, "calls": {"gather": 1, "reduce": 1}, "gathered": True,
                                     "reduced": True}
    assert len(report) == 8
    for case, result in report.items():
        results = result if isinstance(result, list) else [result]
        for one in results:
            assert one == {"gather": True, "gather_aliased": True, "gather_in_place": True, "reduce": True,
                           "reduce_aliased": True}, (case, result)
