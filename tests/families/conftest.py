"""What the conformance tests share, built once per test session and case: the tiny transformer,
its diffusers folder, the folder's pipeline (diffusers' own loader), its single files, a trained
adapter of each `[lora] type` and its files (see `Built`)."""

from __future__ import annotations

import copy
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

RANK, ALPHA = 4, 8.0        # alpha / rank = 2: folding it into lora_B (diffusers layout) is exact
ADAPTER_TYPES = ("lora", "lokr", "loha", "dora")      # [lora] type (train/adapter_types.py)
SIMULATED_TESTS = ("test_planner_prices_it_without_weights_as_the_simulated_device_measures",)


def pytest_collection_modifyitems(config, items):
    """The simulated device must be set up before any backward of the process (memory/simulated.py):
    after collection, before the first test, when a test that needs it was collected."""
    if any(item.originalname in SIMULATED_TESTS for item in items if hasattr(item, "originalname")):
        from leantune.memory import simulated

        try:
            simulated.enable()
        except simulated.SimulatedDeviceUnavailable:
            pass            # the test reports it (simulated.enable raises again there)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models are microseconds per op: a second intra-op thread only waits on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lora_config(targets: str = "all_linear", kind: str = "lora"):
    """A [lora] section: rank 4 (LoKr: its w1 whole, its w2 whole on the tiny models' narrow
    Linears and a product on the wider ones, so both of ComfyUI's LoKr scales are exercised)."""
    return SimpleNamespace(rank=RANK, effective_alpha=ALPHA, alpha=ALPHA, dropout=0.0, targets=targets, blocks=None,
                           type=kind, factor=-1, decompose_both=False, optimizer_step="device")


def frozen(*modules):
    """Modules in eval mode without gradients, as inference runs them. Models compared bit for bit
    must agree on requires_grad too: torch's CPU linear takes another kernel for a weight that
    requires grad (measured: 1e-6 apart on the same values, even under no_grad)."""
    for m in modules:
        if isinstance(m, torch.nn.Module):
            m.eval().requires_grad_(False)
    return modules[0] if len(modules) == 1 else modules


class Built:
    """One case's artefacts, each made on first use and kept for the session."""

    def __init__(self, case, root: Path):
        from leantune.models.family import get_family

        self.case, self.root = case, root
        self.family = get_family(case.family)
        self.spec = self.family.spec

    @cached_property
    def tiny(self) -> torch.nn.Module:
        """The tiny preset's transformer (never modified: tests copy it)."""
        return frozen(self.case.transformer())

    @cached_property
    def folder(self) -> Path:
        return self.case.folder(self.root / "folder")

    def sources(self, path: Path | None = None, **model):
        from leantune.config import ModelConfig

        return self.family.resolve_sources(ModelConfig(path=str(path or self.folder), family=self.case.family, **model),
                                           self.root)

    @cached_property
    def pipeline(self):
        """The folder read by diffusers' own DiffusionPipeline.from_pretrained (fp32, as written)."""
        from diffusers import DiffusionPipeline

        parts = self.case.pipeline_parts()
        try:
            # diffusers' way to pass a component: a pipeline whose constructor reads one
            # (QwenImage21Pipeline's processor) cannot be built with it missing
            pipe = DiffusionPipeline.from_pretrained(str(self.folder), local_files_only=True, **parts)
        except AttributeError:
            # diffusers looks a passed component's class up in the library model_index.json names, which
            # a tiny stand-in defined elsewhere (Qwen-Image-Edit's processor) is not in: loaded as None,
            # then registered
            pipe = DiffusionPipeline.from_pretrained(str(self.folder), local_files_only=True,
                                                     **{k: None for k in parts})
            pipe.register_modules(**parts)
        pipe.set_progress_bar_config(disable=True)
        frozen(*pipe.components.values())
        return pipe

    def pipeline_with(self, **parts):
        """A pipeline of the folder's components, `parts` (transformer=..., ...) replaced, with the
        folder's pipeline settings (model_index.json values its constructor takes besides the
        components: Krea2Pipeline's text_encoder_select_layers, a distilled pipeline's is_distilled)."""
        import inspect

        pipe = self.pipeline
        cls = type(pipe)
        settings = {k: pipe.config[k] for k in inspect.signature(cls.__init__).parameters
                    if k != "self" and k not in pipe.components and k in pipe.config}
        return cls(**{**pipe.components, **settings, **parts})

    @cached_property
    def single_files(self) -> dict[str, Path]:
        """The tiny transformer in the spec's single-file layout, as a full fine-tune exports it
        (train/full_export.write_model_file: the layout's own prefix), and under the other prefix
        ComfyUI's files use ("" or "model.diffusion_model."): {prefix: file}."""
        from leantune.io import load_safetensors, save_safetensors
        from leantune.train.full_export import single_file_metadata, write_model_file

        layout = self.spec.single_file
        access = SimpleNamespace(get=lambda m, attr: getattr(m, attr).detach())
        path = write_model_file(self.tiny, self.spec, access, self.root / "export.safetensors", "comfyui",
                                torch.float32, single_file_metadata(self.tiny, self.spec, 0))
        other = "" if layout.prefix else "model.diffusion_model."
        tensors, meta = load_safetensors(path)
        renamed = {other + k[len(layout.prefix):]: v for k, v in tensors.items()}
        return {layout.prefix: path, other: save_safetensors(renamed, self.root / "other_prefix.safetensors", meta)}

    @cached_property
    def lora(self):
        """A LoRA on every Linear (all_linear: the non-block layers too) with random nonzero values,
        as after training; its files in both layouts; the trained model's deltas (peft's own). The
        model is frozen (see `frozen`); a test that trains it turns its LoRA's gradients on."""
        return self.adapter("lora")

    def adapter(self, kind: str):
        """`lora` for any [lora] type (made once per type): the model with a random adapter of
        `kind` on every Linear (DoRA's magnitudes near the base rows' norms, every other factor
        random), its weights, its files in both layouts with the LoraCompatibilityWarnings their
        export gave (`warned`: {layout: [message]}), and each adapted Linear's weight as peft's own
        merge makes it (`merged`: the trained weights a loader must reproduce); `deltas` for LoRA."""
        if kind not in self._adapters:
            self._adapters[kind] = self._make_adapter(kind)
        return self._adapters[kind]

    @cached_property
    def _adapters(self) -> dict:
        return {}

    def _make_adapter(self, kind: str):
        import warnings

        from leantune.train.lora import (LoraCompatibilityWarning, add_lora, lora_layers, lora_weights_from_model,
                                         save_lora)

        model = copy.deepcopy(self.tiny)
        params = add_lora(model, self.spec, lora_config(kind=kind))
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in params:
                if p.dim() == 1:        # DoRA's magnitude: near the base rows' norms, as after training
                    p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        frozen(model)
        weights = lora_weights_from_model(model)
        layers = lora_layers(model, "default")
        deltas = ({n: layer.get_delta_weight("default").detach() for n, layer in layers.items()}
                  if kind == "lora" else None)
        merged = {}
        for name, layer in lora_layers(copy.deepcopy(model), "default").items():
            layer.merge(adapter_names=["default"])
            merged[name] = layer.get_base_layer().weight.detach().clone()
        files, warned = {}, {}
        suffix = "" if kind == "lora" else f"_{kind}"
        for fmt in ("diffusers", "comfyui"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", LoraCompatibilityWarning)
                files[fmt] = save_lora(weights, self.root / f"lora{suffix}_{fmt}.safetensors", fmt)
            warned[fmt] = [str(w.message) for w in caught if issubclass(w.category, LoraCompatibilityWarning)]
        return SimpleNamespace(kind=kind, model=model, weights=weights, deltas=deltas, merged=merged, files=files,
                               warned=warned)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """built(case) -> the case's `Built`, made once per session."""
    made: dict[str, Built] = {}

    def get(case) -> Built:
        if case.id not in made:
            made[case.id] = Built(case, tmp_path_factory.mktemp(case.id.replace(".", "_")))
        return made[case.id]

    return get


@pytest.fixture(scope="session")
def shape_images(tmp_path_factory):
    """Two 64 px training images with captions."""
    from leantune.demo import draw_shapes

    folder = tmp_path_factory.mktemp("families_shapes") / "images"
    draw_shapes(folder, count=2, size=64, seed=5)
    return folder
