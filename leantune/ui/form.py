"""The run form of the page as a leantune TOML config.

The page sends plain field values; `RunForm.from_fields` checks them (an error names the field),
`to_toml` writes the config a user could have written by hand, and `write` saves it atomically and
checks it with the same validation `leantune train` applies, so a bad form never starts a run.
Choices are read from where they are defined: the families from the family registry
(models/family.py), so a family the project gains appears here with nothing to edit; mode, dtype
and mixed precision from the config schema, so the form offers what the trainer takes.
"""

from __future__ import annotations

import re
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class FormError(ValueError):
    """A form field the page sent is wrong; the message names the field."""


def choices(section: str, key: str) -> list[str]:
    """The values a Literal config key accepts, e.g. choices("model", "family")."""
    from ..config import RunConfig

    model = RunConfig.model_fields[section].annotation
    return [str(v) for v in typing.get_args(model.model_fields[key].annotation)]


def families() -> list[str]:
    """The model families the registry knows (models/family.py), imported or not."""
    from ..models import family

    return sorted(family.known_families())


@dataclass
class RunForm:
    name: str = "my-lora"
    model_path: str = ""
    family: str = "flux"
    dtype: str = "bf16"
    mode: str = "lora"
    dataset: str = ""
    trigger_word: str = ""
    rank: int = 16
    resolutions: list[int] = field(default_factory=lambda: [1024])
    batch_size: int = 1
    max_text_length: int = 512
    steps: int = 1000
    learning_rate: float = 1e-4
    mixed_precision: str = "bf16"
    vram_budget: str = ""          # "" = no budget (everything on the GPU), "auto", or a size
    ram_budget: str = "auto"       # "auto" or "" = the config's default (available host RAM), or a size
    save_every: int = 250
    log_every: int = 1             # the page's loss curve reads the step lines of train.log
    sample_every: int = 250
    sample_prompts: list[str] = field(default_factory=list)
    sample_steps: int = 20
    sample_size: int = 1024

    @classmethod
    def from_fields(cls, data: dict) -> "RunForm":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise FormError(f"unknown form field(s): {', '.join(unknown)}")
        values = {}
        for key, raw in data.items():
            kind = known[key].type
            values[key] = _convert(key, raw, kind)
        form = cls(**values)
        form.check()
        return form

    def check(self) -> None:
        if not NAME.match(self.name):
            raise FormError(f"name {self.name!r}: letters, digits, '-', '_' or '.', starting with a letter or digit")
        for key, allowed in (("family", families()), ("mode", choices("train", "mode")),
                             ("dtype", choices("model", "dtype")),
                             ("mixed_precision", choices("train", "mixed_precision"))):
            if getattr(self, key) not in allowed:
                raise FormError(f"{key} {getattr(self, key)!r}: one of {', '.join(allowed)}")
        if not self.model_path.strip():
            raise FormError("model_path: give the model folder or single .safetensors file")
        if not self.dataset.strip():
            raise FormError("dataset: give the folder of images")
        for key in ("rank", "batch_size", "max_text_length", "steps", "log_every", "sample_steps", "sample_size"):
            if getattr(self, key) < 1:
                raise FormError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not self.resolutions:
            raise FormError("resolutions: give at least one")
        if not self.learning_rate > 0:
            raise FormError(f"learning_rate: must be > 0, got {self.learning_rate}")

    def to_dict(self) -> dict:
        """The config as a TOML document (nested dict); paths absolute, outputs beside the config."""
        cfg: dict = {
            "model": {"path": str(Path(self.model_path).expanduser()), "family": self.family, "dtype": self.dtype},
            "data": {"resolutions": list(self.resolutions), "batch_size": self.batch_size,
                     "max_text_length": self.max_text_length, "cache_dir": "cache",
                     "datasets": [{"path": str(Path(self.dataset).expanduser()), "trigger_word": self.trigger_word}]},
            "lora": {"rank": self.rank, "alpha": self.rank},
            "train": {"mode": self.mode, "steps": self.steps, "learning_rate": self.learning_rate,
                      "mixed_precision": self.mixed_precision, "save_every": self.save_every,
                      "log_every": self.log_every},
            "memory": {},
            "output": {"dir": "run", "name": self.name},
        }
        if self.mode == "full":
            del cfg["lora"]
        if self.vram_budget.strip():
            cfg["memory"]["vram_budget"] = self.vram_budget.strip()
        if self.ram_budget.strip() and self.ram_budget.strip().lower() != "auto":
            cfg["memory"]["ram_budget"] = self.ram_budget.strip()
        if not cfg["memory"]:
            del cfg["memory"]
        if self.sample_prompts and self.sample_every:
            cfg["sample"] = {"every": self.sample_every, "prompts": list(self.sample_prompts),
                             "steps": self.sample_steps, "width": self.sample_size, "height": self.sample_size}
        return cfg

    def to_toml(self) -> str:
        import tomli_w

        return "# written by `leantune ui`; `leantune train` runs it the same way\n" + tomli_w.dumps(self.to_dict())

    def write(self, path: Path) -> Path:
        """Save the TOML atomically and load it back as `leantune train` would (ConfigError if bad)."""
        from ..config import load_config
        from ..io import atomic_write_bytes

        atomic_write_bytes(path, self.to_toml().encode())
        load_config(path)
        return path

    def as_fields(self) -> dict:
        return asdict(self)


def _convert(key: str, raw, kind):
    try:
        if kind == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "str":
            if not isinstance(raw, (str, int, float)):
                raise ValueError
            return str(raw)
        if kind == "list[int]":
            items = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
            return [int(x) for x in items]
        if kind == "list[str]":
            items = raw.splitlines() if isinstance(raw, str) else list(raw)
            return [str(x).strip() for x in items if str(x).strip()]
    except (TypeError, ValueError):
        pass
    raise FormError(f"{key}: {raw!r} is not a valid {kind}")
