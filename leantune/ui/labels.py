"""Errors in the page's words: a config key or form field named by the label the page shows.

The form (form.py, sample_job.py) and the config check (config.py) name what is wrong by its
internal key (`model_path:`, `[memory]: key 'vram_budget'`); a newcomer sees labels. RUN_FIELDS is
the one table from config keys to form field ids; the labels themselves are read from index.html,
so a label the page renames is named the new way with nothing to edit here. `on_field` turns a
message into {"error": text naming the label, "field": id or None}, which the page shows once,
beside the field. A key the extra TOML sets is named as the TOML wrote it (the user's own words),
under the extra TOML's label, since that is where the user has to look.
"""

from __future__ import annotations

import functools
import html.parser
import re
import tomllib
from pathlib import Path

PAGE = Path(__file__).parent / "static" / "index.html"

# config "section.key" -> the run form field that writes it
RUN_FIELDS = {
    "model.path": "model_path", "model.family": "family", "model.dtype": "dtype", "model.expert": "expert",
    "model.image_to_video": "image_to_video", "memory.max_base_error": "max_base_error",
    "lora.experts": "lora_experts", "sample.references": "sample_references",
    "data.resolutions": "resolutions", "data.batch_size": "batch_size", "data.max_text_length": "max_text_length",
    "data.prior_loss": "prior_loss", "data.prior_ratio": "prior_ratio",
    "data.target_fps": "target_fps", "data.max_frames": "max_frames", "sample.frames": "sample_frames",
    "lora.rank": "rank", "lora.targets": "lora_targets", "lora.type": "lora_type",
    "train.mode": "mode", "train.steps": "steps", "train.learning_rate": "learning_rate",
    "train.optimizer": "optimizer", "train.lr_scheduler": "lr_scheduler", "train.warmup_steps": "warmup_steps",
    "train.timestep_sampling": "timestep_sampling", "train.seed": "seed",
    "train.mixed_precision": "mixed_precision", "train.save_every": "save_every", "train.log_every": "log_every",
    "memory.vram_budget": "vram_budget", "memory.ram_budget": "ram_budget", "memory.base_format": "base_format",
    "sample.every": "sample_every", "sample.prompts": "sample_prompts", "sample.steps": "sample_steps",
    "sample.width": "sample_size", "sample.height": "sample_size", "sample.guidance": "sample_guidance",
    "sample.seed": "sample_seed", "ema.enabled": "ema", "ema.decay": "ema_decay",
    "validation.fraction": "validation_fraction", "validation.every": "validation_every",
    "output.name": "name",
}
FIELDS = RUN_FIELDS                  # the name the tests and older callers use
# [[data.datasets]] #n key -> field: the first dataset is the form's, the second its prior folder
DATASET_FIELDS = {1: {"path": "dataset", "trigger_word": "trigger_word", "repeats": "repeats",
                      "caption_dropout": "caption_dropout", "mask_path": "mask_folder", "mask_floor": "mask_floor"},
                  2: {"path": "prior_folder", "default_caption": "prior_caption"}}
# the Sample form: sample_job.py's keys -> the page's ids
SAMPLE_FIELDS = {"model_path": "s_model", "family": "s_family", "prompts": "s_prompts",
                 "negative_prompt": "s_negative", "seed": "s_seed", "steps": "s_steps", "guidance": "s_guidance",
                 "width": "s_width", "height": "s_height", "vram": "s_vram", "loras": "s_loras",
                 "text_length": "s_text_length", "dtype": "s_dtype", "frames": "s_frames"}
# the dataset view's own controls (no part of the run form) its routes' messages name
DATASET_TOOLS = ("caption_model", "caption_prompt", "caption_op", "caption_text", "caption_find")
EXTRA = "extra_toml"

SOURCE = re.compile(r"^(?:the config|\(the form\)\S*|\S*config\.toml|<config>):\s+")
CONFIG_LINE = re.compile(r"^(\[\[?([a-z_.]+)\]?\])(?: #(\d+))?:\s+(?:key '([a-z_]+)'( item \d+)?|unknown key '([a-z_]+)')"
                         r":?\s*(.*)$", re.S)
CONFIG_KEY = re.compile(r"\[\[?([a-z_.]+)\]?\](?: #(\d+))?:?\s+(?:key\s+')?([a-z_]+)'?")
HEAD = re.compile(r"^\s*([a-z_]+)\b:?\s*")


class _Labels(html.parser.HTMLParser):
    """Each form control's label text: a <label for=id> or a <label> around the control, the words
    before the control (a nested <select>'s options are no part of its name)."""

    CONTROLS = ("input", "select", "textarea")

    def __init__(self):
        super().__init__()
        self.found: dict[str, str] = {}
        self.open: dict | None = None      # the label being read: {"for", "text", "reading"}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "label":
            self.open = {"for": a.get("for"), "text": [], "reading": True}
        elif tag in self.CONTROLS and self.open is not None and a.get("id"):
            if self.open["for"] is None:
                self._keep(a["id"])
            self.open["reading"] = False

    def handle_endtag(self, tag):
        if tag == "label" and self.open is not None:
            if self.open["for"]:
                self._keep(self.open["for"])
            self.open = None

    def handle_data(self, data):
        if self.open is not None and self.open["reading"]:
            self.open["text"].append(data)

    def _keep(self, ident: str) -> None:
        words = " ".join("".join(self.open["text"]).split())
        if words and ident not in self.found:
            self.found[ident] = words


@functools.cache
def labels() -> dict[str, str]:
    """Field id -> its on-page label text."""
    parser = _Labels()
    parser.feed(PAGE.read_text())
    return parser.found


@functools.cache
def page_ids() -> frozenset[str]:
    """Every id in index.html (a field an error names must be one of them)."""
    return frozenset(re.findall(r'\bid="([^"]+)"', PAGE.read_text()))


def on_field(message: str, extra_toml: str = "", form: str = "run", default: str | None = None) -> dict:
    """{"error": the first problem in the page's words, "field": the id of the field it is about
    (None when no field holds it)}, plus "problems" (every problem, each {"error", "field"}) when
    the message holds more than one. `extra_toml`: the form's extra TOML (a key it sets is its
    problem, not the field's); `form`: "run" or "sample"; `default`: the field a message that names
    none is about (the dataset route's folder, say)."""
    found = problems(message, extra_toml, form, default)
    out = dict(found[0])
    if len(found) > 1:
        out["problems"] = found
    return out


def problems(message: str, extra_toml: str = "", form: str = "run", default: str | None = None) -> list[dict]:
    """Every problem of the message, one {"error", "field"} each (a config check lists one a line)."""
    try:
        extra = tomllib.loads(extra_toml) if extra_toml.strip() else {}
    except tomllib.TOMLDecodeError:
        extra = {}
    text = message.strip()
    lines = text.splitlines()
    if lines and lines[0].rstrip().endswith(":") and lines[0].startswith("invalid "):
        lines = lines[1:]
    out = [_one(SOURCE.sub("", line.strip()), extra, form, default) for line in lines if line.strip()]
    return out or [{"error": text, "field": default}]


def _one(line: str, extra: dict, form: str, default: str | None) -> dict:
    names = labels()
    own = SAMPLE_FIELDS if form == "sample" else {k: k for k in names if k in _run_ids() or k in DATASET_TOOLS}
    head = HEAD.match(line)
    if head and head.group(1) in own and not CONFIG_LINE.match(line):
        ident = own[head.group(1)]
        rest = line[head.end():]
        if ident == EXTRA:
            return {"error": f"{names[EXTRA]}: {rest}", "field": EXTRA}
        return {"error": f"{names.get(ident, ident)}: {_words(rest, extra)}", "field": ident}
    found = CONFIG_LINE.match(line)
    if found:
        where, section, index, key, item, unknown, rest = found.groups()
        rest = _tidy(rest)
        if unknown:                       # the fields write only known keys: the extra TOML holds it
            return {"error": f"{names[EXTRA]}: {where} unknown key '{unknown}'{_after(rest)}", "field": EXTRA}
        ident = _field(section, index, key, extra)
        if ident and ident != EXTRA:
            return {"error": f"{names[ident]}{item or ''}: {_words(rest, extra)}", "field": ident}
        if ident == EXTRA or key:
            return {"error": f"{names[EXTRA]}: {where}{' #' + index if index else ''} {key}{item or ''}: {rest}",
                    "field": EXTRA}
        inner = HEAD.match(rest)           # a dataset's own check: "mask_floor: set, but ..."
        if index and inner and _field(section, index, inner.group(1), extra) not in (None, EXTRA):
            ident = _field(section, index, inner.group(1), extra)
            return {"error": f"{names[ident]}: {_words(rest[inner.end():], extra)}", "field": ident}
        return {"error": f"{names[EXTRA]}: {where}: {rest}", "field": EXTRA}
    keys = list(CONFIG_KEY.finditer(line))
    if keys:                               # a check across keys: each named by its label
        fields = [_field(m.group(1), m.group(2), m.group(3), extra) for m in keys]
        mapped = [f for f in fields if f and f != EXTRA]
        if not mapped:
            return {"error": f"{names[EXTRA]}: {_tidy(line)}", "field": EXTRA}
        return {"error": _words(_tidy(line), extra, keys=True), "field": mapped[0]}
    if default and default in names:        # the route knows the field: the message is about it
        return {"error": f"{names[default]}: {_tidy(line)}", "field": default}
    return {"error": _tidy(line), "field": default}


@functools.cache
def _run_ids() -> frozenset[str]:
    from dataclasses import fields

    from .form import RunForm

    return frozenset(f.name for f in fields(RunForm))


def _field(section: str, index: str | None, key: str, extra: dict) -> str | None:
    """The run form field that writes `[section] key` (#index for [[data.datasets]]), EXTRA when the
    extra TOML sets that key itself, None when neither does."""
    if _set_in(extra, section, index, key):
        return EXTRA
    if section == "data.datasets":
        return DATASET_FIELDS.get(int(index or 1), {}).get(key)
    return RUN_FIELDS.get(f"{section}.{key}")


def _set_in(extra: dict, section: str, index: str | None, key: str) -> bool:
    node = extra
    for part in section.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, list):             # an array of tables: the extra TOML replaces them whole
        return True
    return isinstance(node, dict) and key in node


def _words(text: str, extra: dict, keys: bool = False) -> str:
    """Other fields and config keys a message names, as the page's labels ("no mask_folder" -> "no
    "Mask folder""); a key the extra TOML sets stays as written."""
    names = labels()
    if keys or "[" in text:
        def label(m: re.Match) -> str:
            ident = _field(m.group(1), m.group(2), m.group(3), extra)
            return f'"{names[ident]}"' if ident and ident != EXTRA else m.group(0)
        text = re.sub(r"\[\[?([a-z_.]+)\]?\](?: #(\d+))?\s+([a-z_]+)\b", label, text)
    return re.sub(r"\b([a-z]+_[a-z_]+)\b",
                  lambda m: f'"{names[m.group(1)]}"' if m.group(1) in names and m.group(1) in _run_ids()
                  and m.group(1) != EXTRA else m.group(0), text)


def _tidy(text: str) -> str:
    """Pydantic's prefixes and a repeated input left out: "Value error, 'x' is ... (got 'x')" -> "'x' is ..."."""
    text = text.replace("Value error, ", "").strip()
    got = re.search(r"\s*\(got (.*)\)$", text)
    if got and got.group(1) in text[:got.start()]:
        text = text[:got.start()]
    return text


def _after(rest: str) -> str:
    return f"{rest}" if rest.startswith(";") else (f": {rest}" if rest else "")
