"""The run form of the page as a leantune TOML config.

The page sends plain field values; `RunForm.from_fields` checks them (an error names the field),
`to_toml` writes the config a user could have written by hand, and `write` saves it atomically and
checks it with the same validation `leantune train` applies, so a bad form never starts a run.
Choices are read from where they are defined: the families from the family registry
(models/family.py), so a family the project gains appears here with nothing to edit; mode, dtype
and mixed precision from the config schema, so the form offers what the trainer takes.

The common keys are fields; every other key of the config is reachable through `extra_toml`, TOML
text merged over what the fields write (tables merged key by key, other values replaced), then
checked by the same validation `leantune train` applies, so an error names the section and key.
An existing TOML (a user's file, examples/, the quickstart recipes) comes back as fields plus the
rest as extra TOML (`from_toml`), so importing and saving again loses no key.
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


def gpu_cards() -> dict[str, str]:
    """The GPUs a plan can be made for without having one (planner/cards.py): key -> its name."""
    from ..planner.cards import CARDS

    return {key: card.title for key, card in CARDS.items()}


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
    expert: str = "auto"           # [model] expert: Wan 2.2 A14B's expert(s) a run trains (high, low, both)
    lora_experts: str = "each"     # [lora] experts, for expert "both": a LoRA per expert or one shared
    image_to_video: str = "off"    # [model] image_to_video (Wan 2.2 TI2V-5B): "on" trains from each clip's first frame
    mode: str = "lora"
    dataset: str = ""
    trigger_word: str = ""
    repeats: int = 1
    caption_dropout: float = 0.0
    mask_folder: str = ""          # [[data.datasets]] mask_path: a mask per image by stem ("" = no masks)
    mask_floor: float = 0.0        # ... mask_floor: the loss weight where a mask is black
    prior_folder: str = ""         # a second dataset, role = "prior": class images ("" = none)
    prior_caption: str = ""        # ... its default_caption: the class prompt ("a photo of a dog")
    prior_loss: str = "plain"      # [data] prior_loss: plain or dop
    prior_ratio: float = 0.25      # [data] prior_ratio: the share of steps on a prior batch
    rank: int = 16
    lora_type: str = "lora"        # [lora] type: lora, dora, lokr, loha
    lora_targets: str = "attention_mlp"
    resolutions: list[int] = field(default_factory=lambda: [1024])
    batch_size: int = 1
    max_text_length: int = 512
    target_fps: str = ""           # [data] target_fps: the rate clips are resampled to ("": the model's own)
    max_frames: int = 81           # [data] max_frames: the longest clip window trained (4k+1 frames)
    steps: int = 1000
    learning_rate: float = 1e-4
    optimizer: str = "adamw"
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    timestep_sampling: str = "auto"
    seed: int = 42
    mixed_precision: str = "bf16"
    vram_budget: str = ""          # "" = no budget (everything on the GPU), "auto", or a size
    ram_budget: str = "auto"       # "auto" or "" = the config's default (available host RAM), or a size
    base_format: str = "auto"      # [memory] base_format: how the frozen base's block Linears are stored
    max_base_error: str = ""       # [memory] max_base_error: the error (%) "auto" may choose within ("": e4m3's)
    plan_gpu: str = ""             # the page's plan only (no config key): a card of planner/cards.py, "" = this GPU
    save_every: int = 250
    log_every: int = 1             # the page's loss curve reads the step lines of train.log
    sample_every: int = 250
    sample_prompts: list[str] = field(default_factory=list)
    sample_steps: int = 20
    sample_size: int = 1024
    sample_guidance: float = 3.5
    sample_seed: int = 0
    sample_frames: int = 0         # [sample] frames of a video family's samples (0: [data] max_frames)
    sample_references: list[str] = field(default_factory=list)   # [sample] references: an edit's or a Wan i2v's
    ema: str = "off"               # [ema] enabled: "on" / "off"
    ema_decay: float = 0.999       # [ema] decay
    validation_fraction: float = 0.0   # [validation] fraction of the images held out (0 = no validation)
    validation_every: int = 100    # [validation] every
    extra_toml: str = ""           # every other key, as TOML merged over the fields

    @classmethod
    def from_fields(cls, data: dict, complete: bool = True) -> "RunForm":
        """The form from the page's values; `complete=False` lets the model and dataset be empty (an
        imported recipe whose paths the user still has to give)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise FormError(f"unknown form field(s): {', '.join(unknown)}")
        values = {}
        for key, raw in data.items():
            kind = known[key].type
            values[key] = _convert(key, raw, kind)
        form = cls(**values)
        form.check(complete)
        return form

    def check(self, complete: bool = True) -> None:
        if not NAME.match(self.name):
            raise FormError(f"name {self.name!r}: letters, digits, '-', '_' or '.', starting with a letter or digit")
        for key, allowed in (("family", families()), ("mode", choices("train", "mode")),
                             ("dtype", choices("model", "dtype")),
                             ("mixed_precision", choices("train", "mixed_precision")),
                             ("lora_type", choices("lora", "type")),
                             ("lora_targets", choices("lora", "targets")), ("optimizer", choices("train", "optimizer")),
                             ("lr_scheduler", choices("train", "lr_scheduler")),
                             ("timestep_sampling", choices("train", "timestep_sampling")),
                             ("prior_loss", choices("data", "prior_loss")), ("ema", ["off", "on"]),
                             ("base_format", choices("memory", "base_format")),
                             ("expert", choices("model", "expert")), ("lora_experts", choices("lora", "experts")),
                             ("image_to_video", ["off", "on"])):
            if getattr(self, key) not in allowed:
                raise FormError(f"{key} {getattr(self, key)!r}: one of {', '.join(allowed)}")
        if self.plan_gpu and self.plan_gpu not in gpu_cards():
            raise FormError(f"plan_gpu {self.plan_gpu!r}: one of {', '.join(gpu_cards())}, or empty for this machine's GPU")
        self._check_video()
        if complete and not self.model_path.strip():
            raise FormError("model_path: give the model folder or single .safetensors file")
        if complete and not self.dataset.strip():
            raise FormError("dataset: give the folder of images")
        for key in ("rank", "batch_size", "max_text_length", "steps", "log_every", "sample_steps", "sample_size",
                    "repeats"):
            if getattr(self, key) < 1:
                raise FormError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.caption_dropout <= 1:
            raise FormError(f"caption_dropout: between 0 and 1, got {self.caption_dropout}")
        self._check_recipe()
        self.extra()          # the extra TOML parses
        if not self.resolutions:
            raise FormError("resolutions: give at least one")
        if not self.learning_rate > 0:
            raise FormError(f"learning_rate: must be > 0, got {self.learning_rate}")

    def _check_video(self) -> None:
        """The video fields, named as the page names them (the config checks the frame counts
        against the family's VAE: 4k+1)."""
        _positive_or_empty("target_fps", self.target_fps, "a frame rate above 0 (or empty: the model's own)")
        if self.max_frames < 1:
            raise FormError(f"max_frames: at least 1 frame, got {self.max_frames}")
        _positive_or_empty("max_base_error", self.max_base_error, "a percentage above 0 (or empty: fp8 e4m3's)")
        if self.sample_frames < 0:
            raise FormError(f"sample_frames: 0 (the longest clip's frames) or a frame count, got {self.sample_frames}")

    def _check_recipe(self) -> None:
        """The recipe options' fields (masks, priors, EMA, validation), named as the page names them;
        the config's own validation checks the rest when the TOML is written."""
        if not 0 <= self.mask_floor < 1:
            raise FormError(f"mask_floor: at least 0 and below 1, got {self.mask_floor}")
        if self.mask_floor and not self.mask_folder.strip():
            raise FormError("mask_floor: set, but no mask_folder; give the folder of masks (or set the floor to 0)")
        if not 0 < self.prior_ratio < 1:
            raise FormError(f"prior_ratio: between 0 and 1 (exclusive), got {self.prior_ratio}")
        if self.prior_caption.strip() and not self.prior_folder.strip():
            raise FormError("prior_caption: set, but no prior_folder; give the folder of prior (class) images")
        if self.prior_loss == "dop" and not self.prior_folder.strip():
            raise FormError('prior_loss "dop": needs a prior_folder of class images (their captions are the '
                            'class prompts the base is kept on)')
        if not 0 < self.ema_decay < 1:
            raise FormError(f"ema_decay: between 0 and 1 (exclusive), got {self.ema_decay}")
        if not 0 <= self.validation_fraction <= 0.5:
            raise FormError(f"validation_fraction: from 0 (no validation) to 0.5, got {self.validation_fraction}")
        if self.validation_every < 1:
            raise FormError(f"validation_every: must be >= 1, got {self.validation_every}")

    def to_dict(self) -> dict:
        """The config as a TOML document (nested dict); paths absolute, outputs beside the config."""
        cfg: dict = {
            "model": {"path": _absolute(self.model_path), "family": self.family, "dtype": self.dtype},
            "data": {"resolutions": list(self.resolutions), "batch_size": self.batch_size,
                     "max_text_length": self.max_text_length, "cache_dir": "cache",
                     "datasets": [{"path": _absolute(self.dataset), "trigger_word": self.trigger_word,
                                   "repeats": self.repeats, "caption_dropout": self.caption_dropout}]},
            "lora": {"rank": self.rank, "targets": self.lora_targets},       # alpha: the config's default, = rank
            "train": {"mode": self.mode, "steps": self.steps, "learning_rate": self.learning_rate,
                      "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler,
                      "warmup_steps": self.warmup_steps, "timestep_sampling": self.timestep_sampling,
                      "seed": self.seed, "mixed_precision": self.mixed_precision, "save_every": self.save_every,
                      "log_every": self.log_every},
            "memory": {},
            "output": {"dir": "run", "name": self.name},
        }
        if self.lora_type != "lora":
            cfg["lora"]["type"] = self.lora_type
        self._recipe_into(cfg)
        if self.mode == "full":
            del cfg["lora"]
        if self.vram_budget.strip():
            cfg["memory"]["vram_budget"] = self.vram_budget.strip()
        if self.ram_budget.strip() and self.ram_budget.strip().lower() != "auto":
            cfg["memory"]["ram_budget"] = self.ram_budget.strip()
        if self.base_format != "auto":
            cfg["memory"]["base_format"] = self.base_format
        if self.max_base_error.strip():
            cfg["memory"]["max_base_error"] = float(self.max_base_error)
        if not cfg["memory"]:
            del cfg["memory"]
        if self.sample_prompts and self.sample_every:
            cfg["sample"] = {"every": self.sample_every, "prompts": list(self.sample_prompts),
                             "steps": self.sample_steps, "width": self.sample_size, "height": self.sample_size,
                             "guidance": self.sample_guidance, "seed": self.sample_seed}
        self._video_into(cfg)
        merge(cfg, self.extra())
        for key in ("dir", "name"):            # the page finds its runs by these
            if cfg["output"][key] != ("run" if key == "dir" else self.name):
                raise FormError(f"extra_toml: [output] {key} is set by the page (the run's name and folder)")
        return cfg

    def _video_into(self, cfg: dict) -> None:
        """The video fields as [data] / [sample] keys, each only when it differs from the config's
        default, so an image run's TOML is the one it was before these fields existed."""
        from ..config import DataConfig

        if self.target_fps.strip():         # empty: the video family's own rate (Wan 2.2 A14B 16, TI2V-5B 24)
            cfg["data"]["target_fps"] = float(self.target_fps)
        if self.max_frames != DataConfig.model_fields["max_frames"].default:
            cfg["data"]["max_frames"] = self.max_frames
        if self.sample_frames and "sample" in cfg:
            cfg["sample"]["frames"] = self.sample_frames
        if self.sample_references and "sample" in cfg:
            cfg["sample"]["references"] = [_absolute(p) for p in self.sample_references]
        if self.image_to_video == "on":
            cfg["model"]["image_to_video"] = True
        if self.expert != "auto":
            cfg["model"]["expert"] = self.expert
            if self.expert == "both" and self.mode == "lora":
                cfg["lora"]["experts"] = self.lora_experts

    def _recipe_into(self, cfg: dict) -> None:
        """The recipe options' fields as config keys; each only when set, so a form left at its
        defaults writes the TOML it wrote before these fields existed."""
        first = cfg["data"]["datasets"][0]
        if self.mask_folder.strip():
            first["mask_path"] = _absolute(self.mask_folder)
            if self.mask_floor:
                first["mask_floor"] = self.mask_floor
        if self.prior_folder.strip():
            prior = {"path": _absolute(self.prior_folder), "role": "prior"}
            if self.prior_caption.strip():
                prior["default_caption"] = self.prior_caption.strip()
            cfg["data"]["datasets"].append(prior)
            cfg["data"]["prior_loss"] = self.prior_loss
            cfg["data"]["prior_ratio"] = self.prior_ratio
        if self.ema == "on":
            cfg["ema"] = {"enabled": True, "decay": self.ema_decay}
        if self.validation_fraction:
            cfg["validation"] = {"fraction": self.validation_fraction, "every": self.validation_every}

    def extra(self) -> dict:
        """The extra TOML as a dict; a syntax error names the line."""
        import tomllib

        try:
            return tomllib.loads(self.extra_toml)
        except tomllib.TOMLDecodeError as e:
            raise FormError(f"extra_toml: {e}") from None

    @classmethod
    def from_toml(cls, text: str, keep: "RunForm | None" = None) -> tuple["RunForm", list[str]]:
        """A config's TOML as the form: known keys as fields, the rest as extra TOML. Paths that are
        relative (to a file the page cannot see) keep `keep`'s values; the notes say which."""
        import copy
        import tomllib

        import tomli_w

        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise FormError(f"the TOML does not parse: {e}") from None
        rest = copy.deepcopy(doc)
        keep = keep or cls()
        values, notes = {}, []

        def take(section, key, field_name, convert=lambda v: v):
            table = rest.get(section)
            if isinstance(table, dict) and key in table:
                values[field_name] = convert(table.pop(key))
                if not table:
                    del rest[section]
        model = doc.get("model", {})
        take("model", "family", "family")
        take("model", "dtype", "dtype")
        take("model", "expert", "expert")
        take("lora", "experts", "lora_experts")
        if "path" in model:
            path = str(rest["model"].pop("path"))
            if Path(path).expanduser().is_absolute():
                values["model_path"] = path
            else:
                notes.append(f"[model] path = {path!r} is relative to its file: give the model's folder")
        datasets = rest.get("data", {}).pop("datasets", None) if isinstance(rest.get("data"), dict) else None
        if datasets:
            first = dict(datasets[0])
            path = str(first.pop("path", ""))
            if Path(path).expanduser().is_absolute():
                values["dataset"] = path
            elif path:
                notes.append(f"[[data.datasets]] path = {path!r} is relative to its file: give the image folder")
            for key, field_name in (("trigger_word", "trigger_word"), ("repeats", "repeats"),
                                    ("caption_dropout", "caption_dropout")):
                if key in first:
                    values[field_name] = first.pop(key)
            if Path(str(first.get("mask_path", ""))).expanduser().is_absolute():
                values["mask_folder"] = str(first.pop("mask_path"))
                if "mask_floor" in first:
                    values["mask_floor"] = first.pop("mask_floor")
            prior = _prior_fields(datasets[1]) if len(datasets) == 2 else None
            if prior is not None:                   # the fields hold it: [data]'s prior keys go with it
                values.update(prior)
                data_table = rest["data"]
                for key in ("prior_loss", "prior_ratio"):
                    if key in data_table:
                        values[key] = data_table.pop(key)
            if first or len(datasets) > 1 + (prior is not None):
                notes.append("more dataset keys or datasets than the fields hold: kept as [[data.datasets]] in "
                             "the extra TOML, which replaces the field's dataset")
                rest.setdefault("data", {})["datasets"] = datasets
        for key, field_name in (("resolutions", "resolutions"), ("batch_size", "batch_size"),
                                ("max_text_length", "max_text_length"), ("max_frames", "max_frames")):
            take("data", key, field_name)
        take("data", "target_fps", "target_fps", lambda v: f"{float(v):g}")
        if isinstance(rest.get("data"), dict) and rest["data"].get("cache_dir") == "cache":
            take("data", "cache_dir", "_")             # what the form writes anyway
        take("lora", "rank", "rank")
        take("lora", "targets", "lora_targets")
        take("lora", "type", "lora_type")
        for key in ("mode", "steps", "learning_rate", "optimizer", "lr_scheduler", "warmup_steps",
                    "timestep_sampling", "seed", "mixed_precision", "save_every", "log_every"):
            take("train", key, key)
        take("memory", "vram_budget", "vram_budget")
        take("memory", "ram_budget", "ram_budget")
        take("memory", "base_format", "base_format")
        take("memory", "max_base_error", "max_base_error", lambda v: f"{float(v):g}")
        if isinstance(rest.get("model"), dict) and rest["model"].get("image_to_video") is True:   # false: as written
            take("model", "image_to_video", "image_to_video", lambda v: "on")
        for key, field_name in (("every", "sample_every"), ("prompts", "sample_prompts"), ("steps", "sample_steps"),
                                ("guidance", "sample_guidance"), ("seed", "sample_seed"), ("frames", "sample_frames")):
            take("sample", key, field_name)
        references = rest.get("sample", {}).get("references") if isinstance(rest.get("sample"), dict) else None
        if references and all(Path(str(p)).expanduser().is_absolute() for p in references):
            take("sample", "references", "sample_references")
        sample = rest.get("sample", {})
        if isinstance(sample, dict) and "width" in sample and sample.get("width") == sample.get("height"):
            values["sample_size"] = sample.pop("width")
            sample.pop("height")
            if not sample:
                del rest["sample"]
        if isinstance(rest.get("ema"), dict) and rest["ema"].get("enabled") is True:   # off: kept as written
            take("ema", "decay", "ema_decay")
            take("ema", "enabled", "ema", lambda v: "on")
        take("validation", "fraction", "validation_fraction")
        if "validation_fraction" in values:
            take("validation", "every", "validation_every")
        take("output", "name", "name")
        take("output", "dir", "_")
        values.pop("_", None)
        for section in [k for k, v in rest.items() if isinstance(v, dict) and not v]:
            del rest[section]
        fields_now = keep.as_fields()
        fields_now.update(values)
        fields_now["extra_toml"] = tomli_w.dumps(rest) if rest else ""
        return cls.from_fields(fields_now, complete=False), notes

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


def _positive_or_empty(key: str, text: str, what: str) -> None:
    """A field that is empty (the config's own choice) or a number above 0; else named as `what`."""
    if not text.strip():
        return
    try:
        ok = float(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise FormError(f"{key}: {what}, got {text!r}")


def presets() -> dict[str, Path]:
    """The recipes the page offers: the package's quickstart*.toml and the repository's examples/."""
    package = Path(__file__).resolve().parents[1]
    found = {f"quickstart: {p.stem}": p for p in sorted((package / "resources").glob("quickstart*.toml"))}
    found.update({f"example: {p.stem}": p for p in sorted((package.parent / "examples").glob("*.toml"))})
    return found


def _prior_fields(dataset: dict) -> dict | None:
    """A second dataset as the prior fields, if it is a prior dataset the fields hold whole (an
    absolute path, a class prompt, nothing else); None keeps it in the extra TOML."""
    d = dict(dataset)
    if d.pop("role", None) != "prior" or not Path(str(d.get("path", ""))).expanduser().is_absolute():
        return None
    out = {"prior_folder": str(d.pop("path"))}
    if "default_caption" in d:
        out["prior_caption"] = d.pop("default_caption")
    return out if not d else None


def _absolute(path: str) -> str:
    """A path typed on the page, absolute (relative to where the page was started: the config lives
    in the run's folder, where a relative path would point elsewhere); a stock model name (planned
    without weights) stays a name."""
    from ..commands.plan import MODELS

    if not path.strip() or path.strip() in MODELS:
        return path.strip()
    return str(Path(path).expanduser().absolute())


def merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, in place: tables merged key by key, anything else replaced."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


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
