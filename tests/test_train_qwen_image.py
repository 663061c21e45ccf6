"""End-to-end training on the tiny Qwen-Image, by `[model] family = "qwen-image"` alone: the caches
(Qwen VAE latents, Qwen2.5-VL text rows of varying length), flow matching with the family's shift
sampling, the memory engine (every block streamed with poisoned slots, offloaded checkpointing)
reproducing the plain run, fp8 storage near it, and a full fine-tune whose exported folder loads
back (exact resume of a LoRA run: tests/families/test_conformance.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.tiny import qwen_image as tq
from leantune.models.family import get_family
from leantune.train import flow_matching as fm
from leantune.trainer import train

RUN = """
[model]
family = "qwen-image"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 64

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"
caption_dropout = 0.2

[lora]
rank = 4
alpha = 8
targets = "all"

[train]
steps = 8
learning_rate = 1e-3
mixed_precision = "no"
save_every = 4
keep_last = 5
seed = 3
gradient_accumulation = 2

[output]
dir = "out"
name = "t"
formats = ["diffusers", "comfyui"]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tq.save_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen-tiny")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=6, size=64, seed=5)
    return folder


def make_config(tmp_path, model, images, extra=(), text=RUN):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "run.toml"
    p.write_text(text.format(model=model, images=images))
    return load_config(p, list(extra))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, model_dir, images):
    cfg = make_config(tmp_path_factory.mktemp("reference"), model_dir, images)
    return cfg, train(cfg, progress=False)


def test_schedule_default_is_shift():
    assert fm.sampling_method("auto", get_family("qwen-image")) == "shift"


def test_lora_run_trains_and_caches_the_pipelines_text(reference_run, model_dir):
    """The run trains (finite losses, the adapter moved), writes both formats, and the cached empty
    caption equals QwenImagePipeline.encode_prompt("") rounded to bf16 (its real rows only)."""
    from diffusers import QwenImagePipeline

    cfg, result = reference_run
    assert len(result.losses) == 8 and all(torch.isfinite(torch.tensor(result.losses)))
    lora = load_file(str(result.paths.lora_file("diffusers")))
    assert any(k.endswith("img_mod.1.lora_B.weight") for k in lora)
    # Every adapter moved but those whose output only the last block's unused text stream reads.
    unused = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    still = {k for k, v in lora.items() if k.endswith("lora_B.weight") and not torch.count_nonzero(v)}
    assert still == {f"transformer.transformer_blocks.1.{m}.lora_B.weight" for m in unused}
    assert result.paths.lora_file("comfyui").is_file()
    from leantune.data.cache import prepare_caches
    from leantune.models.component_loading import dtype_from_name

    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", dtype_from_name(cfg.model.dtype))
    assert data.stats["text"].hits > 0 and data.stats["text"].misses == 0      # a hit loads no encoder
    t5, pooled = data.text_entry("")
    pipe = QwenImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    ref, mask = pipe.encode_prompt("", device="cpu", max_sequence_length=64)
    assert mask is None and pooled.numel() == 0
    assert torch.equal(t5.float(), ref[0].to(torch.bfloat16).float())


@pytest.mark.slow
def test_under_the_memory_engine(tmp_path, model_dir, images):
    """Streaming every block with poisoned slots and offloaded checkpointing reproduces the plain
    run; fp8 storage (modulation Linears kept in the compute dtype) stays near it."""
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    plain = train(make_config(tmp_path / "plain", model_dir, images, cache), progress=False, stop_after=4)
    engine = train(make_config(tmp_path / "engine", model_dir, images,
                               cache + ["memory.streamed_blocks=all", "memory.checkpointing=offload",
                                        "memory.debug_poison=true"]), progress=False, stop_after=4)
    assert engine.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-7)
    assert "memory plan: stream 2 blocks" in engine.paths.log_file.read_text()
    fp8 = train(make_config(tmp_path / "fp8", model_dir, images, cache + ["memory.fp8=true"]), progress=False,
                stop_after=4)
    assert "fp8=on" in fp8.paths.log_file.read_text()
    assert fp8.losses != plain.losses
    assert fp8.losses == pytest.approx(plain.losses, rel=0.05)


@pytest.mark.slow
def test_full_fine_tune(tmp_path, model_dir, images):
    """[train] mode = "full": every block weight trains and the exported diffusers folder loads back
    through the Qwen-Image loader with the trained weights."""
    text = RUN.split("[lora]")[0] + """
[train]
mode = "full"
steps = 3
learning_rate = 1e-4
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "f"
formats = ["diffusers"]
"""
    cfg = make_config(tmp_path, model_dir, images, text=text)
    result = train(cfg, progress=False)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    fam = get_family("qwen-image")
    from leantune.config import ModelConfig

    before = fam.load_transformer(fam.resolve_sources(cfg.model, Path(cfg.base_dir)), dtype=torch.float32)
    folder = next(p for p in result.paths.root.iterdir() if p.name.endswith("_diffusers") and p.is_dir())
    after = fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(folder), family="qwen-image"), Path("/")),
                                 dtype=torch.float32)
    a, b = before.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    for k in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.txt_mlp.net.2.weight",
              "transformer_blocks.0.img_mod.1.weight", "img_in.weight"):
        assert k in changed
