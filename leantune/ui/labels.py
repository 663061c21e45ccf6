"""Errors in the page's words: a config key or form field named by the label the page shows.

The form (form.py) and the config check (config.py) name what is wrong by its internal key
(`model_path:`, `[memory] vram_budget`); a newcomer sees labels. FIELDS is the one table from
config keys to form field ids; the labels themselves are read from index.html, so a label the
page renames is named the new way with nothing to edit here. `on_field` turns a message into
{"field": id or None, "message": text naming the label}, which the page shows once, beside the field.
"""

from __future__ import annotations

import functools
import html
import re
from pathlib import Path

PAGE = Path(__file__).parent / "static" / "index.html"

# config "[section] key" -> the form field that writes it
FIELDS = {
    "model.path": "model_path", "model.family": "family", "model.dtype": "dtype",
    "data.resolutions": "resolutions", "data.batch_size": "batch_size", "data.max_text_length": "max_text_length",
    "data.prior_loss": "prior_loss", "data.prior_ratio": "prior_ratio",
    "lora.rank": "rank", "lora.targets": "lora_targets", "lora.type": "lora_type",
    "train.mode": "mode", "train.steps": "steps", "train.learning_rate": "learning_rate",
    "train.optimizer": "optimizer", "train.lr_scheduler": "lr_scheduler", "train.warmup_steps": "warmup_steps",
    "train.timestep_sampling": "timestep_sampling", "train.seed": "seed",
    "train.mixed_precision": "mixed_precision", "train.save_every": "save_every", "train.log_every": "log_every",
    "memory.vram_budget": "vram_budget", "memory.ram_budget": "ram_budget",
    "sample.every": "sample_every", "sample.prompts": "sample_prompts", "sample.steps": "sample_steps",
    "sample.width": "sample_size", "sample.height": "sample_size", "sample.guidance": "sample_guidance",
    "sample.seed": "sample_seed", "ema.enabled": "ema", "ema.decay": "ema_decay",
    "validation.fraction": "validation_fraction", "validation.every": "validation_every",
}
# a section the form has no field for is named in page words
SECTIONS = {"model": "Model", "data": "Dataset", "lora": "LoRA", "train": "Training", "memory": "Memory budgets",
            "sample": "Samples", "ema": "EMA", "validation": "Validation", "output": "Output"}
LABEL = re.compile(r'<label[^>]*>(.*?)<(?:input|select|textarea)[^>]*\bid="([a-z_]+)"', re.S)
CONFIG_KEY = re.compile(r"\[\[?([a-z_]+)(?:\.[a-z_]+)?\]?\]\s*([a-z_]+)")


@functools.cache
def labels() -> dict[str, str]:
    """Field id -> its on-page label text (the text before the control, tags stripped)."""
    out = {}
    for text, ident in LABEL.findall(PAGE.read_text()):
        words = html.unescape(re.sub(r"<[^>]+>", "", text)).strip()
        if words and ident not in out:
            out[ident] = words
    return out


def on_field(message: str) -> dict:
    """The message naming the field by its label, and the field's id (None when no field holds it)."""
    names = labels()
    head = re.match(r"\s*([a-z_]+)\b:?\s*", message)
    if head and head.group(1) in names and head.group(1) != "extra_toml":
        ident = head.group(1)
        return {"field": ident, "message": f"{names[ident]}: {message[head.end():]}"}
    found = CONFIG_KEY.search(message)
    if found:
        section, key = found.groups()
        ident = FIELDS.get(f"{section}.{key}")
        if ident:
            return {"field": ident, "message": f"{names[ident]}: " + _tail(message, found)}
        place = f"{names['extra_toml']} ({SECTIONS.get(section, section)} settings, {key})"
        return {"field": "extra_toml", "message": f"{place}: " + _tail(message, found)}
    if head and head.group(1) == "extra_toml":
        return {"field": "extra_toml", "message": f"{names['extra_toml']}: {message[head.end():]}"}
    return {"field": None, "message": message}


def _tail(message: str, found: re.Match) -> str:
    rest = message[found.end():].lstrip(" :=,")
    return rest.splitlines()[0].strip() if rest.strip() else message.splitlines()[-1].strip()
