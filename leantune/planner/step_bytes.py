"""The optimizer update's temporaries per element, measured once for this code and shipped.

What it trades: a small JSON file in the package (planner/profiles/step_bytes.json) for a first
full fine-tune plan that runs no update under a storage tracker. Measuring is cheap in itself
(milliseconds per setting), but a storage tracker is a torch dispatch mode, and the first one a
process enters imports torch._dynamo: 1.1-1.4 s of a 4 s first plan on a 2-core machine.

What is measured (full_model.py's docstring says how it is priced): `InBackwardStep`'s own update
of one small real CPU tensor, for each optimizer setting, on the torch-op path a device step runs
and with the host kernels a host step runs (train/host_kernels.py), as (bytes per element of the
stepped tensor, bytes whatever its size). Those numbers follow the code and the torch version, not
the machine: the shipped table is keyed by a fingerprint of the modules that decide them and the
torch version (as the shipped profiles are: spec_cache.py), so a table the code no longer matches
is not used and the setting is measured afresh. The host kernels' numbers are used only where the
kernels are built here (without them the host step runs the torch ops, which allocate more).
scripts/make_plan_profiles.py writes the table; tests/test_plan_profiles.py checks it is current.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from importlib import metadata
from pathlib import Path

import torch

log = logging.getLogger("leantune")

# The modules whose code decides the measured bytes (relative to the leantune package).
_STEP_CODE = ("planner/step_bytes.py", "train/fused_optim.py", "train/in_backward.py", "train/host_kernels.py",
              "train/host_kernels.c", "native.py", "memory/simulated.py")
SHIPPED_PATH = Path(__file__).resolve().parent / "profiles" / "step_bytes.json"
OPTIMIZERS = ("adamw", "adafactor", "sgd", "adamw8bit")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MEASURED: dict = {}      # (optimizer, dtype, state dtype, rounding, master, clip, host) -> (per element, fixed)
_shipped: dict | None = None


class _NoStep:
    """An optimizer that changes nothing: isolates what clipping allocates (8-bit AdamW's own
    step is bitsandbytes' fused in-place kernel)."""

    def step_param(self, p, g, weight=None, lr=None, max_grad_norm=0.0, grad_norm=None) -> None:
        from ..train.fused_optim import clip_in_place

        if max_grad_norm > 0:
            clip_in_place(g, max_grad_norm)


def coefficients(optimizer: str, dtype: torch.dtype, state_dtype: str, stochastic_rounding: bool, master: bool,
                 clip: bool, host: bool) -> tuple[float, int]:
    """(bytes per element, fixed bytes) one update allocates beside its incoming gradient: from the
    shipped table when it is of this code, else measured on CPU tensors of two sizes."""
    key = (optimizer, dtype, state_dtype, stochastic_rounding, master, clip, host)
    if key not in _MEASURED:
        shipped = _shipped_table().get(_name(key)) if not host or _host_kernels_built() else None
        _MEASURED[key] = tuple(shipped) if shipped is not None else measure(*key)
    return _MEASURED[key]


def measure(optimizer, dtype, state_dtype, sr, master, clip, host) -> tuple[float, int]:
    """(bytes per element, fixed bytes) of one update, from its peaks on tensors of 96 and 192 rows."""
    small, large = (_measure_step(optimizer, dtype, state_dtype, sr, master, clip, rows=r, host=host)
                    for r in (96, 192))
    return (large - small) / (96 * 128), int(round(small - (large - small)))


def _measure_step(optimizer, dtype, state_dtype, sr, master, clip, rows: int, host: bool) -> int:
    from ..memory.simulated import DeviceMemoryTracker
    from ..train.fused_optim import FusedOptimizer
    from ..train.in_backward import InBackwardStep

    shape = (rows, 128)
    lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    if optimizer == "adamw8bit":
        opt = _NoStep()
    else:
        opt = FusedOptimizer(lin, {"weight": lin.weight}, optimizer, lr=1e-3, state_dtype=state_dtype,
                             stochastic_rounding=sr, master_weights=master, host_kernels=host, scheduled=False)
        opt._generator(lin.weight.device)
    stepper = InBackwardStep(opt, [], max_grad_norm=1.0 if clip else 0.0)
    peak = 0
    for _ in range(2):                 # the second step: state and generator exist, as in a run
        grad = torch.ones(shape, dtype=dtype)
        tracker = DeviceMemoryTracker()
        with tracker:
            stepper._update(lin.weight, grad)
        peak = max(tracker.peak.values(), default=0)
    return peak


def _name(key: tuple) -> str:
    optimizer, dtype, state_dtype, sr, master, clip, host = key
    dname = next((n for n, d in DTYPES.items() if d == dtype), str(dtype))
    return f"{optimizer}|{dname}|{state_dtype}|sr={int(sr)}|master={int(master)}|clip={int(clip)}|host={int(host)}"


def _host_kernels_built() -> bool:
    from ..train import host_kernels

    return host_kernels.library() is not None


def fingerprint() -> str:
    """The code and torch version the table is the measurement of."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _STEP_CODE:
        path = root / rel
        h.update(rel.encode())
        h.update(path.read_bytes() if path.exists() else b"-")
    try:
        h.update(f"torch={metadata.version('torch')}".encode())
    except metadata.PackageNotFoundError:
        h.update(b"torch=none")
    return h.hexdigest()[:16]


def _shipped_table() -> dict:
    """name -> [per element, fixed] of the shipped table, or {} when it is absent, unreadable or of
    other code."""
    global _shipped
    if _shipped is None:
        _shipped = {}
        if SHIPPED_PATH.exists():
            try:
                entry = json.loads(SHIPPED_PATH.read_text())
                if entry["code"] == fingerprint():
                    _shipped = {k: (float(v[0]), int(v[1])) for k, v in entry["coefficients"].items()}
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                log.warning("planner: ignoring unreadable %s (%s); measuring", SHIPPED_PATH, e)
    return _shipped


def every_setting() -> list[tuple]:
    """Every key `coefficients` can be asked for."""
    return [(o, d, s, sr, m, c, h) for o, d, s, sr, m, c, h in itertools.product(
        OPTIMIZERS, DTYPES.values(), ("fp32", "bf16"), (False, True), (False, True), (False, True), (False, True))]


def ship(path: Path = SHIPPED_PATH) -> Path:
    """Measure every setting and write the table (scripts/make_plan_profiles.py), atomically. Host
    settings are measured with the host kernels, which must be built here."""
    if not _host_kernels_built():
        raise RuntimeError("the host kernels are not built here (train/host_kernels.py): the shipped host "
                           "coefficients would be those of the torch-op fallback")
    table = {}
    for key in every_setting():
        try:
            table[_name(key)] = list(measure(*key))
        except (ValueError, RuntimeError, TypeError) as e:      # a setting the optimizer refuses: measured (and refused) at plan time
            log.info("step bytes: %s not shipped (%s)", _name(key), e)
    blob = json.dumps({"code": fingerprint(), "coefficients": table}, sort_keys=True, indent=0)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(blob + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
