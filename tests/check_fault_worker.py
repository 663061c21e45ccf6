"""Run on every process by torchrun in tests/test_check_processes.py (not a test module itself).

The check's several-processes worker (leantune/check/processes.py) with a fault injected where a
real one would sit: rank 1 scales its gradient share by 1.5 before the all-reduce (a rank whose
loss weighting or gradient reduction is wrong), so the ranks' summed gradient is not the
one-process gradient of the doubled batch. Every rank still takes part in every collective, so
the run finishes and only the check's comparison can see the fault.
"""

import os
import sys

import torch

from leantune.check import processes
from leantune.distributed import DistContext

_sync = DistContext.sync_gradients


def _scaled_on_rank_1(self, params):
    if self.rank == 1:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.5)
    return _sync(self, params)


if __name__ == "__main__":
    assert os.environ.get("RANK") is not None, "run by torchrun"
    DistContext.sync_gradients = _scaled_on_rank_1
    sys.exit(processes.worker(sys.argv[1], sys.argv[2:]))
