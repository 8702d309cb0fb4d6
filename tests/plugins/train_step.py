"""Build the fixture plugin's task, model and criterion through metaseq_ds and take optimizer steps.

    python tests/plugins/train_step.py PLUGIN_DIR [--compat]

Prints one JSON line: the losses of each step and the old packages imported along the way.
"""

import json
import sys

import torch

if "--compat" in sys.argv:
    import compat

    compat.install()

from metaseq_ds import tasks
from metaseq_ds.options import parse_train_config

cfg = parse_train_config([
    "--user-dir", sys.argv[1], "--task", "counting", "--arch", "bag_of_words_tiny", "--criterion", "token_nll",
])
torch.manual_seed(0)  # the plugin's model draws its own initial values: the same ones on every run
task = tasks.setup_task(cfg.task)
model = task.build_model(cfg.model)
criterion = task.build_criterion(cfg.criterion)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
losses = []
for _ in range(5):
    loss, sample_size, _ = criterion(model, task.batch())
    optimizer.zero_grad()
    (loss / sample_size).backward()
    optimizer.step()
    losses.append(loss.item() / sample_size)
print(json.dumps({
    "losses": losses,
    "embed_dim": cfg.model.embed_dim,
    "old_packages": sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "metaseq", "fairseq_cli")),
}))
