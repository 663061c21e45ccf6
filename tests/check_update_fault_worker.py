"""Run on every process by torchrun in tests/test_check_processes.py (not a test module itself).

The check's several-processes worker (leantune/check/processes.py) with a fault injected where a
sharded full fine-tune's rank could go wrong: rank 1 applies 1.5 times the update its AdamW
computed to the weights it steps (FSDP2: its shards of every weight; DeepSpeed ZeRO-2: its
partition of the flat fp32 weights, which DeepSpeed then gathers to every rank), as a rank whose
learning rate, step count or moments were wrong would. Every rank still takes part in every
collective, so the run finishes and only the check's comparison can see the fault.
"""

import os
import sys

import torch

from leantune.check import processes

_step = torch.optim.AdamW.step


def _scaled_on_rank_1(self, *args, **kwargs):
    params = [p for group in self.param_groups for p in group["params"]]
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
    out = _step(self, *args, **kwargs)
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b + 1.5 * (p - b))
    return out


if __name__ == "__main__":
    assert os.environ.get("RANK") is not None, "run by torchrun"
    if os.environ["RANK"] == "1":
        torch.optim.AdamW.step = _scaled_on_rank_1
    sys.exit(processes.worker(sys.argv[1]))
