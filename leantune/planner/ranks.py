"""A plan's numbers per process and for the whole machine when N processes (GPUs) train together.

LoRA with DDP semantics (leantune/distributed.py): every process runs the same plan on its own
GPU with `[data] batch_size` samples, so its VRAM is the one-GPU prediction plus one flat buffer
the size of the LoRA gradients (they are flattened for the all-reduce). Host RAM per process is
the one-process breakdown, except that the streamed blocks' buffers are shared by the processes of
a machine ([distributed] share_host_weights, memory/shared_host.py): the machine holds them once.

Loading. Each process holds the whole model before packing it. With [distributed] load_in_turns
(the default) the processes of a machine load one after another (DistContext.local_turns): while
the last one loads, the others are already at their steady state and the streamed buffers exist
once, so the machine's loading peak is (N-1) steady processes + one loading process. Loading all at
once costs N loading peaks.
"""

from __future__ import annotations

from ..memory.plan import Plan

GiB = 2**30


def per_rank(plan: Plan, processes: int, lora_grad_bytes: int, shared: bool = True,
             turns: bool = True) -> dict[str, int]:
    """Predicted bytes: "vram per process", "host per process" (steady, this process's own pages
    plus the shared ones it maps), "host machine steady", "host machine loading" and "host machine
    peak" for `processes` processes running `plan`, loading in turns or all at once."""
    n = plan.notes or {}
    host = n.get("host_breakdown") or {}
    streamed = sum(v for k, v in host.items() if k.startswith("streamed blocks"))
    baseline = host.get("process baseline", 0)
    steady_own = sum(host.get(k, 0) for k in ("staging buffers", "offloaded activations", "caches"))
    loading = max(host.get("transformer while loading", 0), host.get("transformer while converting to fp8", 0),
                  host.get("stored transformer + one unit while packing", 0))
    copies = 1 if shared and processes > 1 else processes
    machine_steady = processes * (baseline + steady_own) + copies * streamed
    if turns and processes > 1:       # the last turn: N-1 processes done, one loading
        done = processes - 1
        machine_loading = (done * (baseline + steady_own) + (streamed if shared else done * streamed)
                           + baseline + loading)
    else:
        machine_loading = processes * (baseline + loading)
    return {
        "vram per process": int(n.get("predicted_peak_vram", 0)) + (lora_grad_bytes if processes > 1 else 0),
        "host per process": baseline + steady_own + streamed,
        "host machine steady": machine_steady,
        "host machine loading": machine_loading,
        "host machine peak": max(machine_steady, machine_loading),
    }


def format_ranks(numbers: dict[str, int], processes: int, shared: bool, turns: bool = True) -> str:
    how = "one shared host copy of the streamed blocks" if shared and processes > 1 else "one host copy per process"
    load = "loading in turns" if turns else "loading at once"
    lines = [f"{processes} processes (ddp, {how}, {load}):"]
    lines.append(f"  VRAM per process (predicted peak)   {numbers['vram per process'] / GiB:9.2f} GiB")
    lines.append(f"  host RAM per process (steps)        {numbers['host per process'] / GiB:9.2f} GiB")
    lines.append(f"  host RAM, machine, while loading    {numbers['host machine loading'] / GiB:9.2f} GiB")
    lines.append(f"  host RAM, machine, during steps     {numbers['host machine steady'] / GiB:9.2f} GiB")
    lines.append(f"  host RAM, machine, predicted peak   {numbers['host machine peak'] / GiB:9.2f} GiB")
    return "\n".join(lines)
