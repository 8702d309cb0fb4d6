"""Run on 2 ranks (`deepspeed --num_gpus 2 tests/logging_reduction_worker.py`): each rank's
logging outputs combined over the ranks (`logging.reduction.combine_over_ranks`), summed and
gathered, and a validation split where one rank has no batch. Rank 0 prints `REDUCTION {...}`."""

import json

import torch

from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.logging.reduction import combine_over_ranks, read_values

dist_utils.init_distributed()
rank = dist_utils.get_global_rank()
# Rank r's two micro-batches: a tensor loss, int counts, a float, a per-sentence tensor.
outputs = [{"loss": torch.tensor(1.5 + rank + step, dtype=torch.float64), "ntokens": 10 * (rank + 1), "nsentences": 2,
            "scale": 0.25, "sentence_nll": torch.tensor([rank + step, 10.0 * rank])} for step in range(2)]
numbers = [{key: value for key, value in output.items() if key != "sentence_nll"} for output in outputs]
summed = combine_over_ranks(numbers, summable=True)
unread = combine_over_ranks(numbers, summable=True, read=False)[0]
gathered = combine_over_ranks(outputs, summable=False)
only_rank_0 = combine_over_ranks(numbers[:1] if rank == 0 else [], summable=True, may_be_empty=True)
if rank == 0:
    print("REDUCTION " + json.dumps({
        "summed": summed,
        "types": {key: type(value).__name__ for key, value in summed[0].items()},
        "gathered": [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in o.items()} for o in gathered],
        "only_rank_0": only_rank_0,
        "unread_types": {key: type(value).__name__ for key, value in unread.items()},
        "unread": read_values([unread]),
    }), flush=True)
