"""Training stats: metaseq's JSON lines (numbers, not strings) and the rich bar."""

import json
import logging

from metaseq_ds.logging.progress_bar import StatsSink, setup_logging


def test_json_lines_carry_numbers_under_the_tag(capsys):
    setup_logging()
    sink = StatsSink("json", None, "none", total=10, enabled=True)
    sink.log("train_inner", {"epoch": 1, "loss": 3.1234567891, "num_updates": 5}, step=5)
    line = capsys.readouterr().out.strip()
    assert " | INFO | train_inner | " in line
    assert json.loads(line.split(" | train_inner | ")[1]) == {"epoch": 1, "loss": 3.123457, "num_updates": 5}


def test_rich_bar_follows_updates_and_stops():
    sink = StatsSink("none", None, "rich", total=10, enabled=True)
    sink.advance(4, {"loss": 2.5, "nll_loss": 2.25, "ppl": 4.756828})  # what the criterion logged
    task = sink.bar.tasks[0]
    assert task.completed == 4 and task.total == 10 and task.fields["stats"] == "loss 2.5 | nll_loss 2.25 | ppl 4.757"
    sink.close()
    assert not sink.bar.live.is_started


def test_other_ranks_write_nothing(capsys):
    setup_logging()
    sink = StatsSink("json", None, "rich", total=10, enabled=False)
    sink.log("train_inner", {"loss": 1.0}, step=1)
    sink.advance(1, {"loss": 1.0})
    assert capsys.readouterr().out == "" and sink.bar is None
    logging.getLogger().handlers.clear()
