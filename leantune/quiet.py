"""Third-party chatter that does not concern a leantune user, silenced before those libraries load.

A newcomer running `leantune demo` saw "CLIPImageProcessor requires torchvision", "modules that
should be kept in float32: []", DeepSpeed's "Setting accelerator to CPU" and diffusers' shard-
writing progress bars: none is about anything they did or can act on (leantune uses no image
processor, casts on purpose, and reports its own progress). The libraries' errors still show;
leantune's own warnings are untouched. `LEANTUNE_VERBOSE=1` keeps everything.

bitsandbytes (NF4 bases, memory/nf4_storage.py) logs "Failed to load CPU gemm_4bit_forward from
kernels-community ..." at import on CPUs with AVX512-BF16 when the optional `kernels` package is
absent, and, where `kernels` is installed (the transformers installed here requires it),
`kernels` logs "Skipping publisher trust check for 'kernels-community/..." as bitsandbytes asks it
for that kernel with the Hub offline: leantune dequantizes with bitsandbytes and never calls that
kernel, so both lines are noise. Each is logged by a child logger with no handler of its own, so
the filter goes on those loggers (a filter on "bitsandbytes" would not see a child's records);
quiet_bitsandbytes() puts it there before the first import.
"""

from __future__ import annotations

import logging
import os
import warnings

# Message starts of third-party warnings known not to concern the user (see the module doc).
_NOISE = (
    r".*requires torchvision",
    r"There are modules in .* that should be kept in float32",
    r"Failed to load CPU gemm_4bit_forward from kernels-community",
    r"Skipping publisher trust check for 'kernels-community/",
)
# where bitsandbytes and `kernels` log the two lines above
_BNB_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        import re

        text = record.getMessage()
        return not any(re.match(p, text, re.S) for p in _NOISE) and "Setting accelerator to CPU" not in text


def quiet_third_party() -> None:
    """Call before diffusers / transformers / DeepSpeed are imported (the env settings are read then)."""
    if os.environ.get("LEANTUNE_VERBOSE"):
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    noise = _DropNoise()
    for name in ("transformers", "diffusers", "DeepSpeed", "accelerate", "peft"):
        logging.getLogger(name).addFilter(noise)
    root = logging.getLogger()
    if not any(isinstance(f, _DropNoise) for f in root.filters):
        root.addFilter(noise)
    for handler in root.handlers:
        handler.addFilter(noise)
    quiet_bitsandbytes()                 # diffusers / transformers import bitsandbytes where it is installed


def quiet_bitsandbytes() -> None:
    """Call before bitsandbytes is imported (memory/nf4_storage.py does): its CPU backend's
    kernels-community line dropped (module doc)."""
    if os.environ.get("LEANTUNE_VERBOSE"):
        return
    for name in _BNB_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
