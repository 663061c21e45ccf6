"""What the planner measures of a model, kept so that planning it again costs milliseconds.

What it trades: a small JSON file per (model source, workload shape) in the leantune cache for a
`leantune plan` that, the second time, builds no meta model, traces nothing and imports neither
diffusers nor peft. Everything the memory model needs from a model is here: the weight bytes per
block (weight_bytes.py), the architecture key (calibration's identity) and the activation profiles
per bucket and storage (activations.py), and, for a family with split blocks (ModelFamily.split_blocks,
memory/split_parts.py), the same with the blocks split (`split_profiles`: what Plan.split_blocks
computes with). A stored measurement without split profiles (a family without split blocks, or one
written before them) still loads: its split plans are absent, the planner prices none.

`measure_model` measures a model (real or meta); `load_measured` / `save_measured` keep the result
under a key the caller derives from where the model comes from (`source_key`: a packaged
architecture, or a checkpoint file's path, size and modification time) and the workload shape
(not the LoRA rank: a profile prices any rank, ActivationProfile.at_rank). The
key also covers the code that measures (the planner's and engine's modules that decide these
numbers, and the torch/diffusers/peft versions), so a change to any of them measures again. An
unreadable, stale or ill-shaped file (a NaN byte count, a string for a number: kept_files.py) is
ignored with one warning naming it, and rewritten.

Shipped profiles: the package carries the measurements of the stock architectures (`leantune plan
--model flux-dev | flux-schnell | sd3.5-large | sd3.5-medium`, LoRA / full / inference at the
default flags, 512 and 1024 px) in planner/profiles/, each a gzipped file named by the same key,
so a first plan of a stock model builds no meta model and traces nothing (the build and the probes
are most of the 10-13 CPU-s a new question costs). The key includes the measuring code and the
library versions: a profile the code no longer matches has another name and is not found, so it
is measured afresh rather than used stale. scripts/make_plan_profiles.py writes them; a test
checks that every shipped profile still matches the code (tests/test_plan_profiles.py).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from ..family_registry import FAMILIES
from ..io import atomic_write_json
from ..native import make_private_folders
from .activations import ActivationProfile
from .corrections import architecture_key, default_calibration_path
from .kept_files import BadKeptFile, check_fields, loads, read_json
from .weight_bytes import AdapterShape, ModelWeights, ModuleWeights, measure_weights
from .workload import Workload

log = logging.getLogger("leantune")

# The modules whose code decides the measured numbers (relative to the leantune package); every
# family folder's family object and spec (models/<family>/__init__.py, spec.py, and an edit.py where
# a second family shares the folder) are added by `_measuring_code`, so a new family is counted.
_MEASURING_CODE = ("planner/weight_bytes.py", "planner/activation_probe.py", "planner/activations.py",
                   "planner/meta.py", "planner/spec_cache.py", "memory/fp8.py", "memory/streaming_units.py",
                   "memory/split_parts.py",
                   "train/full_mode.py", "train/trainable.py",
                   "spec.py", "models/family.py", "train/lora.py")
_FAMILY_MEASURING_FILES = ("__init__.py", "spec.py", "edit.py", "ti2v.py")   # a family module beside __init__
# and what a family's probe copy runs beside them (Qwen-Image-2.1's training block and meta build)
_FAMILY_MEASURING_FILES += ("block.py", "meta_model.py")


def _measuring_code(root: Path, folders: list[str] | None = None) -> list[str]:
    """_MEASURING_CODE and the family object and spec of each family folder in `folders` (None:
    every folder under models/), in a fixed order."""
    families = folders if folders is not None else sorted(p.parent.name for p in (root / "models").glob("*/__init__.py"))
    return list(_MEASURING_CODE) + [f"models/{f}/{name}" for f in families for name in _FAMILY_MEASURING_FILES
                                    if (root / "models" / f / name).exists()]


def _family_folders_of(source: str) -> list[str] | None:
    """The family folders a measurement of `source` depends on: for a packaged architecture
    ("packaged:<config>|dtype"), the folders of the families whose stock models ship that config
    (family_registry.py), so that adding or editing another family's folder leaves its shipped
    profiles valid; None (every folder) for a checkpoint, whose family the key does not say."""
    text = str(source).split("|", 1)[0]
    if not text.startswith("packaged:"):
        return None
    config = text[len("packaged:"):]
    folders = sorted({entry.module.split(".")[2] for entry in FAMILIES.values()
                      if any(model.config == config for model in entry.stock.values())})
    return folders or None


_PROBE_CACHE: dict = {}   # (architecture key, bucket, storage, split) -> ActivationProfile, for this process


@dataclass(frozen=True)
class MeasuredModel:
    """A model as the memory model sees it: weights per block, identity, activation profiles."""

    weights: ModelWeights
    key: str                                                      # architecture_key(model, workload)
    # (bucket, (probed with fp8, with fp8 modulation)) -> profile
    profiles: dict[tuple[tuple[int, int], tuple[bool, bool]], ActivationProfile]
    # the same keys, probed with the family's split blocks splitting (Plan.split_blocks); empty for a
    # family without split blocks and for an inference workload
    split_profiles: dict[tuple[tuple[int, int], tuple[bool, bool]], ActivationProfile] = field(default_factory=dict)

    def profile(self, bucket: tuple[int, int], storage: tuple[bool, bool], split: bool = False) -> ActivationProfile:
        return (self.split_profiles if split else self.profiles)[(tuple(bucket), tuple(storage))]

    def to_dict(self) -> dict:
        def entries(profiles):
            return [{"bucket": list(b), "fp8": f, "modulation": m, "profile": p.to_dict()}
                    for (b, (f, m)), p in profiles.items()]

        d = {"weights": asdict(self.weights), "key": self.key, "profiles": entries(self.profiles)}
        if self.split_profiles:          # a model without split blocks is stored as before them
            d["split_profiles"] = entries(self.split_profiles)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MeasuredModel:
        w = d["weights"]

        def module(m: dict) -> ModuleWeights:
            return ModuleWeights(m["name"], m["kind"], tuple(tuple(t) for t in m["tensors"]), m["native_bytes"],
                                 tuple(tuple(s) for s in m.get("trained", ())),
                                 tuple(tuple(f) for f in m.get("formats", ())))

        weights = ModelWeights(tuple(module(b) for b in w["blocks"]), module(w["non_blocks"]),
                               tuple(AdapterShape(**a) for a in w["adapters"]), w.get("device_tables", 0),
                               w.get("own_numel", 0))
        def entries(items):
            return {(tuple(e["bucket"]), (bool(e["fp8"]), bool(e["modulation"]))):
                    ActivationProfile.from_dict(e["profile"]) for e in items}

        return cls(weights, d["key"], entries(d["profiles"]), entries(d.get("split_profiles", ())))


Storage = tuple[bool, bool]     # (fp8, fp8_modulation), as Plan.storage
# What a kept measurement that does not validate raises on reading (the file is then measured again).
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, ArithmeticError)


def _valid(measured: MeasuredModel) -> MeasuredModel:
    """`measured` if each field is what the planner computes with (a number where it takes one) and
    another LoRA rank can be priced from it; else BadKeptFile naming the field."""
    check_fields(measured.weights, ModelWeights, "weights")
    check_fields(measured.key, str, "key")
    split = [(b, p, " (split blocks)") for (b, _), p in measured.split_profiles.items()]
    for bucket, profile, which in [(b, p, "") for (b, _), p in measured.profiles.items()] + split:
        where = f"profile {bucket[0]}x{bucket[1]}{which}"
        check_fields(profile, ActivationProfile, where)
        if profile.per_rank is not None:
            try:
                other = profile.at_rank(profile.per_rank["rank"] + 1)
            except (KeyError, TypeError, AttributeError, ValueError, ArithmeticError) as e:
                raise BadKeptFile(f"{where}: its per-rank share does not price another rank ({e!r})") from None
            check_fields(other, ActivationProfile, where)
    return measured


def storage_options(workload: Workload, weights: ModelWeights) -> list[Storage]:
    """The (fp8, fp8_modulation) storages the workload's plans may use, plainest first.

    fp8 modulation comes only on top of fp8 (unless the workload forces it), never for a full
    fine-tune (whose fp8 storage, for the block Linears of a frozen part only, is a choice when
    [full] exclude freezes some: ModelWeights.fp8_convertible), and is no choice when the checkpoint already stores the modulation Linears in e4m3
    (the plan then converts nothing more: Plan.fp8_modulation stays False, as Plan.fp8 does for the
    other block weights of an fp8 checkpoint).
    """
    if workload.mode == "full":
        return [(False, False)] + ([(True, False)] if workload.allow_fp8 and weights.fp8_convertible() else [])
    fp8s = [False] + ([True] if workload.allow_fp8 else [])
    forced = workload.fp8_modulation
    if weights.prequantized_modulation or forced is False:
        mods = [False]
    else:
        mods = [True] if forced else [False, True]
    return [(f, m) for m in mods for f in fp8s if f or not m or forced]


def effective_storage(storage: Storage, weights: ModelWeights) -> Storage:
    """What a storage computes with on this model: weights already e4m3 compute through fp8 storage
    in every plan."""
    return (storage[0] or weights.prequantized, storage[1] or weights.prequantized_modulation)


def probed_storages(workload: Workload, weights: ModelWeights) -> list[Storage]:
    """The storages activations are probed with: each storage the workload may use and the plainest
    one (the reference of the dequantisation cost), as the model computes them."""
    return sorted({effective_storage(s, weights) for s in [*storage_options(workload, weights), (False, False)]})


def splits_blocks(spec, workload: Workload) -> bool:
    """Whether plans of this workload may split blocks: a training step (a forward without a graph
    never splits) of a family with split blocks (ModelFamily.split_blocks). Only then is the split
    variant probed, so the other families' probes cost what they did."""
    if workload.mode == "inference":
        return False
    from ..models.family import family_of_spec

    try:
        family = family_of_spec(spec)
    except KeyError:                 # a spec of no registered family
        return False
    return family.split_blocks is not None


def measure_model(spec, model, workload: Workload) -> MeasuredModel:
    """Weights, architecture key and activation profiles of `model` (any device, meta included) for
    every bucket and storage the workload can use, split and not where the family has split blocks
    (splits_blocks). Probes are shared within the process."""
    weights = measure_weights(spec, model, workload)
    key = architecture_key(model, workload)
    profiles: dict = {}
    split_profiles: dict = {}
    for split in (False, True) if splits_blocks(spec, workload) else (False,):
        for storage in probed_storages(workload, weights):
            for bucket in workload.buckets:
                cache_key = (key, bucket, storage, split)
                if cache_key not in _PROBE_CACHE:
                    from .activation_probe import probe_activations   # traces: imports peft and the engine

                    _PROBE_CACHE[cache_key] = probe_activations(spec, model, workload, bucket, fp8=storage[0],
                                                                modulation=storage[1], split=split)
                (split_profiles if split else profiles)[(bucket, storage)] = _PROBE_CACHE[cache_key]
    return MeasuredModel(weights, key, profiles, split_profiles)


def source_key(source: str | Path, dtype: str) -> str:
    """Where a model comes from: "packaged:<name>" for a shipped architecture, else a checkpoint
    path with its size and modification time (a replaced file measures again), and the dtype it loads in."""
    text = str(source)
    if not text.startswith("packaged:"):
        path = Path(source).resolve()
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(_files_of(path))]
        text = json.dumps(stats)
    return f"{text}|{dtype}"


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors")]
    return [path]


def _code_fingerprint(source: str | None = None) -> str:
    """The measuring code (and library versions) a measurement of `source` depends on."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _measuring_code(root, _family_folders_of(source) if source is not None else None):
        path = root / rel
        h.update(rel.encode())
        h.update(path.read_bytes() if path.exists() else b"-")
    for dist in ("torch", "diffusers", "peft"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()[:16]


def _workload_shape(workload: Workload) -> dict:
    """The workload fields that decide what is measured (not the optimizer, accumulation or caches,
    nor the LoRA rank: the probe keeps the adapters' share per rank, ActivationProfile.at_rank)."""
    shape = {f.name: getattr(workload, f.name) for f in fields(workload)}
    unmeasured = ["optimizer", "gradient_accumulation", "host_cache_bytes", "state_dtype", "master_weights",
                  "stochastic_rounding", "clip_per_param", "rank", "streamed_step", "lora_step", "quantizes_on_load",
                  "frozen_adapter_bytes", "frozen_adapter_tensors", "preview_base_bytes", "preview_adapter_tensors", "ema", "dop_share", "validation_forwards_per_step",
                  "prefix_cache_bytes", "base_formats", "max_base_error", "base_pinned", "split_blocks"]
    lora = workload.mode == "lora"
    if lora and workload.adapter == "lokr":
        unmeasured.remove("rank")     # LoKr is traced at its rank (activation_probe.probe_activations)
    else:
        unmeasured += ["lokr_factor", "lokr_decompose_both"]
    if not lora or workload.adapter == "lora":
        unmeasured.append("adapter")  # a plain LoRA's key, as before the adapter types
    if not workload.references:
        unmeasured.append("references")   # text to image keeps its key from before references
    if workload.frames == 1:
        unmeasured.append("frames")       # an image keeps its key from before video
    for key in unmeasured:
        shape.pop(key)
    return shape


SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"


def measurement_key(source: str, workload: Workload) -> dict:
    """What a measurement is the measurement of: the model source, the workload shape and the code
    (with library versions) that measures."""
    return json.loads(json.dumps({"source": source, "workload": _workload_shape(workload),
                                  "code": _code_fingerprint(source)},
                                 sort_keys=True, default=str))


def cache_name(source: str, workload: Workload) -> str:
    blob = json.dumps(measurement_key(source, workload), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_path(source: str, workload: Workload) -> Path:
    return default_calibration_path().parent / "planner" / f"{cache_name(source, workload)}.json"


def shipped_path(source: str, workload: Workload) -> Path:
    return SHIPPED_DIR / f"{cache_name(source, workload)}.json.gz"


def load_measured(source: str, workload: Workload) -> MeasuredModel | None:
    """The stored measurement of `source` for this workload shape (this machine's cache first, then
    the package's shipped profiles), or None (none yet, or unreadable)."""
    path = cache_path(source, workload)
    measured, bad = None, False
    if path.exists():
        try:
            measured = _valid(MeasuredModel.from_dict(read_json(path)))
        except _UNREADABLE as e:
            log.warning("planner: ignoring unreadable cached measurement %s (%s)", path, e)
            bad = True
    if measured is None:
        measured = load_shipped(source, workload)
        if measured is not None and bad:
            save_measured(source, workload, measured)       # replaced, so it is said once
    if measured is None:
        return None
    needed = {(b, f) for f in probed_storages(workload, measured.weights) for b in workload.buckets}
    return measured if needed <= set(measured.profiles) else None


def load_shipped(source: str, workload: Workload) -> MeasuredModel | None:
    """The package's profile of `source` for this workload shape and this code, or None."""
    path = shipped_path(source, workload)
    if not path.exists():
        return None
    try:
        entry = loads(gzip.decompress(path.read_bytes()))
        if entry["key"] != measurement_key(source, workload):      # a name collision, or a hand-edited file
            log.warning("planner: shipped profile %s is not the measurement of this question; measuring", path)
            return None
        return _valid(MeasuredModel.from_dict(entry["measured"]))
    except _UNREADABLE as e:
        log.warning("planner: ignoring unreadable shipped profile %s (%s)", path, e)
        return None


def ship_measured(source: str, workload: Workload, measured: MeasuredModel, folder: Path = SHIPPED_DIR) -> Path:
    """Write `measured` as a shipped profile (scripts/make_plan_profiles.py): gzipped compact JSON
    with its key, written atomically."""
    import os

    path = folder / f"{cache_name(source, workload)}.json.gz"
    blob = json.dumps({"key": measurement_key(source, workload), "measured": measured.to_dict()}, sort_keys=True,
                      separators=(",", ":")).encode()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(gzip.compress(blob, 9, mtime=0))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def save_measured(source: str, workload: Workload, measured: MeasuredModel) -> None:
    """Keep `measured` for the next plan of `source`; a cache that cannot be written only costs time."""
    path = cache_path(source, workload)
    try:
        make_private_folders(path.parent)           # the cache's folders only this user can write (native.py)
        atomic_write_json(path, measured.to_dict())
    except OSError as e:
        log.warning("planner: cannot keep the measurement in %s (%s)", path, e)
