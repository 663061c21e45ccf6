"""Run in a fresh process by tests/test_simulated.py (the simulated device must be enabled before
any backward): six fp32 trained Linears of Flux's width, each checkpointed as the engine
checkpoints streamed blocks, forward under the trainer's bf16 autocast on the simulated GPU.
Prints the forward's peak device bytes above the weights, and one bf16 weight's bytes.
`cached` as argument: torch.autocast with its cast cache on (torch's default) instead."""

import json
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantune.config import validate
from leantune.memory.simulated import DeviceMemoryTracker, enable, simulation
from leantune.simulated_run import fake_parameters
from leantune.trainer import _autocast

WIDTH, LAYERS, TOKENS = 3072, 6, 256


def main() -> None:
    device = enable()
    with torch.device("meta"):
        layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))   # fp32, trained
    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
                    "train": {"mixed_precision": "bf16"}}, "run.toml")
    tracker = DeviceMemoryTracker()
    with simulation(tracker):
        fake_parameters(layers, device)
        x = torch.empty(1, TOKENS, WIDTH, dtype=torch.bfloat16, device=device)
        tracker.reset_peak()
        base = tracker.live.get(str(device), 0)
        ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if sys.argv[1:] == ["cached"]
               else _autocast(cfg, device))
        with ctx:
            y = x
            for layer in layers:
                y = checkpoint(layer, y, use_reentrant=False)
        peak = tracker.peak.get(str(device), 0) - base
    print(json.dumps({"peak": peak, "bf16_weight": WIDTH * WIDTH * 2, "activation": TOKENS * WIDTH * 2,
                      "layers": LAYERS}))


if __name__ == "__main__":
    main()
