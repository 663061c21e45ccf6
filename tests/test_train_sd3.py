"""End-to-end training on the tiny SD3.5: golden LoRA loss curve, the memory engine (streaming,
checkpointing, fp8) through the trainer, and a full fine-tune, all by `[model] family = "sd3"` alone
(exact resume of a LoRA run: tests/families/test_conformance.py)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune import tiny
from leantune.models.family import get_family
from leantune.train import flow_matching as fm
from leantune.trainer import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_sd3_lora_20_steps.json"

RUN = """
[model]
family = "sd3"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 16

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"
caption_dropout = 0.2

[lora]
rank = 4
alpha = 8
targets = "all"

[train]
steps = 20
learning_rate = 1e-3
lr_scheduler = "cosine"
warmup_steps = 3
mixed_precision = "no"
save_every = 10
keep_last = 5
seed = 3
gradient_accumulation = 2

[output]
dir = "out"
name = "t"
formats = ["diffusers"]
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=6, size=64, seed=5)
    return folder


@pytest.fixture(scope="module")
def medium_dir(tmp_path_factory):
    return tiny.save_sd3_folder(tmp_path_factory.mktemp("sd3m") / "sd3-medium", style="medium")


def make_config(tmp_path, model, images, extra=(), text=RUN):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "run.toml"
    p.write_text(text.format(model=model, images=images))
    return load_config(p, list(extra))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_sd3_dir, images):
    cfg = make_config(tmp_path_factory.mktemp("reference"), tiny_sd3_dir, images)
    return cfg, train(cfg, progress=False)


def test_sd3_schedule_defaults():
    assert fm.sampling_method("auto", get_family("sd3")) == "shift"
    assert fm.sampling_method("auto", get_family("flux")) == "sigmoid"
    assert fm.sampling_method("uniform", get_family("sd3")) == "uniform"     # every sampler stays selectable


def test_golden_loss_curve(reference_run):
    """A deterministic 20-step SD3 LoRA run reproduces the stored loss curve (fp32, CPU)."""
    cfg, result = reference_run
    assert len(result.losses) == 20
    if os.environ.get("LEANTUNE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": result.losses}, indent=1))
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert result.losses == pytest.approx(golden, rel=2e-3, abs=1e-5)
    # The run sampled noise levels as SD3 trains (logit-normal shifted by 3) and had no guidance input.
    with safe_open(str(result.lora_files[0]), "pt") as f:
        assert f.metadata()["ss_timestep_sampling"] == "shift"
    log = result.paths.log_file.read_text()
    assert "model: SD3.5 Large-style (2 joint blocks, width 32)" in log
    assert "lora: lora rank 4 alpha 8 on all: 50 tensors" in log     # 2 blocks; the last has no text-stream out/MLP


def test_caption_dropout_trains_on_the_pipelines_empty_prompt(reference_run):
    """Dropped captions use the cached embedding of "", which is StableDiffusion3Pipeline's
    unconditional (negative) embedding: what classifier-free guidance subtracts at sampling."""
    from diffusers import StableDiffusion3Pipeline

    from leantune.data.cache import prepare_caches, sample_prompts

    cfg, _ = reference_run
    empty = prepare_caches(cfg.data, cfg.model, cfg.base_dir, torch.device("cpu"), torch.float32,
                           extra_prompts=sample_prompts(cfg.sample)).prompt_embeds([""])   # all cache hits
    pipe = StableDiffusion3Pipeline.from_pretrained(str(cfg.resolve(cfg.model.path)))
    with torch.no_grad():
        _, neg, _, neg_pooled = pipe.encode_prompt("x", None, None, do_classifier_free_guidance=True,
                                                   max_sequence_length=16)
    assert empty.t5.shape[-2:] == neg.shape[-2:]           # 77 CLIP + 16 T5 rows, nothing trimmed
    # The cache stores bf16: equal to the pipeline's embedding rounded to bf16.
    assert torch.equal(empty.t5.reshape(neg.shape).float(), neg.to(torch.bfloat16).float())
    assert torch.equal(empty.pooled.reshape(neg_pooled.shape).float(), neg_pooled.to(torch.bfloat16).float())


@pytest.mark.slow
def test_medium_under_the_memory_engine(tmp_path, medium_dir, images):
    """MMDiT-X (dual attention) through the trainer: streaming every block with poisoned slots and
    offloaded checkpointing reproduces the plain run; fp8 storage stays near it."""
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]      # one cache for the three runs
    plain = train(make_config(tmp_path / "plain", medium_dir, images, cache), progress=False, stop_after=4)
    engine = train(make_config(tmp_path / "engine", medium_dir, images,
                               cache + ["memory.streamed_blocks=all", "memory.checkpointing=offload",
                                        "memory.debug_poison=true"]), progress=False, stop_after=4)
    assert engine.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-7)
    assert "memory plan: stream 2 blocks" in engine.paths.log_file.read_text()
    fp8 = train(make_config(tmp_path / "fp8", medium_dir, images, cache + ["memory.fp8=true"]), progress=False,
                stop_after=4)
    assert "text: 7 hits" in fp8.paths.log_file.read_text()        # SD3's 77 + 16 rows pass the cache check
    assert "fp8=on" in fp8.paths.log_file.read_text()
    assert fp8.losses != plain.losses
    assert fp8.losses == pytest.approx(plain.losses, rel=0.05)


@pytest.mark.slow
def test_full_fine_tune(tmp_path, tiny_sd3_dir, images):
    """[train] mode = "full" on SD3 by the spec alone: every weight trains and the exported diffusers
    folder loads back through the SD3 loader with the trained weights."""
    text = RUN.split("[lora]")[0] + """
[train]
mode = "full"
steps = 4
learning_rate = 1e-4
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "f"
formats = ["diffusers"]
"""
    cfg = make_config(tmp_path, tiny_sd3_dir, images, text=text)
    result = train(cfg, progress=False)
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    fam = get_family("sd3")
    from leantune.config import ModelConfig

    before = fam.load_transformer(fam.resolve_sources(cfg.model, Path(cfg.base_dir)), dtype=torch.float32)
    folder = next(p for p in result.paths.root.iterdir() if p.name.endswith("_diffusers") and p.is_dir())
    after = fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(folder), family="sd3"), Path("/")),
                                 dtype=torch.float32)
    a, b = before.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    # Every trainable block weight moved (the last block's unused text-stream weights get no gradient).
    assert "transformer_blocks.0.attn.to_q.weight" in changed and "transformer_blocks.1.ff.net.2.weight" in changed
    assert "context_embedder.weight" in changed
