"""A plugin task that keeps state across checkpoints the metaseq way (`self.state.add_factory`):
the fixture of tests/test_task_api.py.

Its state counts the tokens it has trained on, and names the run that built it; each step
prints the state, so a test can see a resumed run carry on with the saved state.
"""

import json
import uuid
from dataclasses import dataclass

from metaseq_ds.tasks import register_task
from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig, StreamingLanguageModelingTask


@dataclass
class TokenCountingConfig(StreamingLanguageModelingConfig):
    pass


@register_task("token_counting_lm", dataclass=TokenCountingConfig)
class TokenCountingTask(StreamingLanguageModelingTask):
    def __init__(self, args):
        super().__init__(args)
        # Built on the first step of a fresh run; a resumed run finds the saved one instead.
        self.state.add_factory("token_counts", lambda: {"built_by": uuid.uuid4().hex, "tokens": 0})

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        result = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        self.state.token_counts["tokens"] += int(sample["ntokens"])
        print("TASK_STATE", json.dumps({"update": update_num, **self.state.token_counts}), flush=True)
        return result
