"""The caching phase's text pass run layer-major (memory/lockstep.py, memory/blockwise.py,
models/streamed_encoder.py; issue 40, finding 6): with the text encoder streamed, every batch of
captions of a pass goes through layer i before layer i+1 is brought, so each layer is read from its
files (or copied from host RAM) once per pass instead of once per batch of 8; the entries are bit
for bit those of the encoder loaded whole. Qwen-Image-Edit's vision tower moves once per pass, not
once per prompt.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from leantune.config import load_config
from leantune.data.cache import TEXT_BATCH, prepare_caches
from leantune.demo import draw_shapes
from leantune.memory import lockstep
from leantune.memory.blockwise import blockwise_offload
from leantune.models.weights import CheckpointFiles
from leantune.tiny import flux2 as tf
from leantune.tiny import qwen_image as tq

RUN = """
[model]
family = "{family}"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "{cache}"
max_text_length = 64

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"
"""

# 20 prompts (3 batches of 8 with the 4 image captions), short and long: padding differs per batch
PROMPTS = ["", "a red circle"] + [" ".join(["two blue squares on a long grey table"] * (k % 5 + 1)) + f" {k}"
                                  for k in range(14)]

FAMILIES = {
    "qwen-image": lambda p: tq.save_qwen_image_folder(p),          # Qwen2.5-VL, last hidden state
    "flux2-klein-4b": lambda p: tf.save_flux2_folder(p, "klein"),  # Qwen3, stacked hidden states, layers cut
}


class Reads:
    """Every tensor read from checkpoint files, by key (what a file-backed encoder costs)."""

    def __init__(self, monkeypatch):
        self.keys: Counter = Counter()
        rows = CheckpointFiles.read_rows_into      # every read of a tensor's bytes goes through it

        def counted_rows(files, key, *a, **k):
            self.keys[key] += 1
            return rows(files, key, *a, **k)

        monkeypatch.setattr(CheckpointFiles, "read_rows_into", counted_rows)

    def per_layer(self) -> dict[int, set[int]]:
        """Layer index -> the read counts of its tensors."""
        out: dict[int, set[int]] = {}
        for key, n in self.keys.items():
            m = re.search(r"\.layers\.(\d+)\.", key)
            if m:
                out.setdefault(int(m.group(1)), set()).add(n)
        return out


def _config(root, model, family, cache):
    p = root / f"{cache}.toml"
    p.write_text(RUN.format(model=model, images=root / "images", cache=cache, family=family))
    return load_config(p, [])


def _args(cfg):
    return cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_file_streamed_pass_reads_each_layer_once_and_matches_the_whole_encoder(tmp_path, monkeypatch, family):
    model = FAMILIES[family](tmp_path / "tiny")
    draw_shapes(tmp_path / "images", count=4, size=64, seed=5)
    cfg = _config(tmp_path, model, family, "cache")
    whole = prepare_caches(*_args(cfg), extra_prompts=PROMPTS)
    misses = whole.stats["text"].misses
    assert misses > 2 * TEXT_BATCH            # three batches: the old loop read every layer three times
    want = {p: whole.text_entry(p) for p in PROMPTS}
    shutil.rmtree(tmp_path / "cache" / "text")          # the latents stay: only the text is encoded again

    reads = Reads(monkeypatch)
    streamed = prepare_caches(*_args(cfg), extra_prompts=PROMPTS, ram_budget=1)   # 1 byte: left in its files
    assert streamed.stats["text"].misses == misses and streamed.stats["latents"].misses == 0
    layers = reads.per_layer()
    assert layers, "nothing was read layer by layer: the encoder was not streamed"
    assert all(counts == {1} for counts in layers.values()), layers       # once per pass, not per batch
    for p in PROMPTS:
        got = streamed.text_entry(p)
        assert torch.equal(got[0], want[p][0]) and torch.equal(got[1], want[p][1]), p


# -- host-resident streaming (blockwise_offload) through lanes --------------------------------------

def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(cfg).eval()
    return model.model, model.model.layers


def _t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,
                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    model = T5EncoderModel(cfg).eval()
    return model, model.encoder.block


def _batches():
    """Four batches of mixed lengths, right-padded with a mask."""
    g = torch.Generator().manual_seed(3)
    out = []
    for lengths in ([3, 6], [7, 2], [5, 5], [1, 4]):
        width = max(lengths)
        ids = torch.randint(1, 97, (len(lengths), width), generator=g)
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        out.append((ids * mask, mask))
    return out


@pytest.mark.parametrize("build", [_qwen3, _t5], ids=["qwen3", "t5"])
@torch.no_grad()
def test_host_streamed_lanes_copy_each_block_once_and_match_the_plain_model(build):
    model, blocks = build()
    hidden = (lambda ids, mask: model(input_ids=ids, attention_mask=mask, output_hidden_states=True))
    plain = [hidden(ids, mask) for ids, mask in _batches()]
    streams, moves = [], []

    def encode(ids, mask):
        with blockwise_offload(model, blocks, "cpu") as stream:
            streams.append(stream)
            return hidden(ids, mask)

    # today's loop: one streamed encode per batch, each copying every block again
    one_by_one = [encode(ids, mask) for ids, mask in _batches()]
    assert [dict(s.loads) for s in streams] == [{0: 1, 1: 1, 2: 1}] * 4
    streams.clear()
    got = lockstep.run_pass([lambda b=b: encode(*b) for b in _batches()], report=moves.extend)
    assert len({id(s) for s in streams}) == 1               # one placement for the pass
    assert dict(streams[0].loads) == {0: 1, 1: 1, 2: 1}      # each block copied once for four batches
    assert [i for _, i in moves] == [0, 1, 2]
    for a, b, c in zip(plain, one_by_one, got):
        assert torch.equal(a.last_hidden_state, c.last_hidden_state)
        assert torch.equal(b.last_hidden_state, c.last_hidden_state)
        assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, c.hidden_states))
    assert all(p.numel() > 0 for p in model.parameters())   # back on the host whole


@torch.no_grad()
def test_state_budget_splits_the_pass_into_rounds_with_the_same_results():
    """A budget below two batches' states lets one batch through the blocks at a time: every block
    moves once per round, and the outputs do not change."""
    model, blocks = _qwen3()
    plain = [model(input_ids=ids, attention_mask=mask).last_hidden_state for ids, mask in _batches()]
    moves, streams = [], []

    def encode(ids, mask):
        with blockwise_offload(model, blocks, "cpu") as stream:
            streams.append(stream)
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

    got = lockstep.run_pass([lambda b=b: encode(*b) for b in _batches()], state_budget=1, report=moves.extend)
    assert [i for _, i in moves] == [0, 1, 2] * 4
    assert dict(streams[0].loads) == {0: 4, 1: 4, 2: 4}
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


@torch.no_grad()
def test_a_failing_lane_stops_the_pass_and_restores_the_model():
    model, blocks = _qwen3()
    (ids, mask), *_ = _batches()

    def encode():
        with blockwise_offload(model, blocks, "cpu"):
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

    def fails():
        with blockwise_offload(model, blocks, "cpu"):
            model(input_ids=ids, attention_mask=mask)
            raise RuntimeError("caption 9 is broken")

    with pytest.raises(RuntimeError, match="caption 9"):
        lockstep.run_pass([encode, fails, encode])
    assert all(p.numel() > 0 for p in model.parameters())
    assert not model.layers[0]._forward_pre_hooks


# -- Qwen-Image-Edit: prompts one by one, the vision tower moved whole ------------------------------

def _refs(seed):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8))]


@torch.no_grad()
def test_edit_pass_reads_each_layer_and_moves_the_vision_tower_once(tmp_path, monkeypatch):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from leantune.models.qwen_image.edit import encode_prompts
    from leantune.models.streamed_encoder import encoder_files, file_backed

    torch.set_num_threads(1)
    comps = tq.qwen_image_edit_components(seed=0)
    whole = comps["text_encoder"]
    proc = comps["processor"].image_processor
    plain = SimpleNamespace(tokenizer=comps["tokenizer"], text_encoder=whole, image_processor=proc,
                            device=torch.device("cpu"))
    chunks = [(["make it red", "a cat"], [_refs(1), _refs(2)]), (["the sky, at night", ""], [_refs(3), None])]
    want = [encode_prompts(p, plain, images=i, device="cpu") for p, i in chunks]

    # the language model left in its files, the vision tower in host RAM (as the loader leaves them)
    save_file({k: v.contiguous() for k, v in whole.state_dict().items()}, tmp_path / "te.safetensors")
    lazy = file_backed(lambda: Qwen2_5_VLForConditionalGeneration(whole.config), encoder_files(tmp_path / "te.safetensors"),
                       "model.language_model", "layers", torch.float32, "text encoder")
    lazy.model.visual = whole.model.visual
    moves = []
    real_to = lazy.model.visual.to
    monkeypatch.setattr(lazy.model.visual, "to", lambda *a, **k: (moves.append(a), real_to(*a, **k))[1])
    reads = Reads(monkeypatch)
    # cpu:0 is not the vision tower's home ("cpu"), so it is moved there as onto a GPU
    enc = SimpleNamespace(tokenizer=comps["tokenizer"], text_encoder=lazy, image_processor=proc,
                          device=torch.device("cpu", 0))
    got = lockstep.run_pass([lambda p=p, i=i: encode_prompts(p, enc, images=i, device=enc.device) for p, i in chunks])

    assert len([m for m in moves if torch.device(m[0]) == enc.device]) == 1      # three prompts with references
    layers = reads.per_layer()
    assert layers and all(counts == {1} for counts in layers.values()), layers    # four prompts, one read
    for (w, wl), (g, gl) in zip(want, got):
        assert torch.equal(w.t5, g.t5) and torch.equal(wl, gl)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_pass_prefetches_on_the_copy_stream_with_the_plain_models_results():
    """On a GPU: blocks copied through pinned staging on the copy stream, prefetched while the
    previous block computes; outputs equal the resident model's on the same GPU, bit for bit."""
    model, blocks = _qwen3()
    resident = [model.cuda()(input_ids=i.cuda(), attention_mask=m.cuda()).last_hidden_state.cpu()
                for i, m in _batches()]
    model.cpu()
    streams = []

    def encode(ids, mask):
        with blockwise_offload(model, blocks, "cuda") as stream:
            streams.append(stream)
            return model(input_ids=ids.cuda(), attention_mask=mask.cuda()).last_hidden_state.cpu()

    got = lockstep.run_pass([lambda b=b: encode(*b) for b in _batches()])
    assert dict(streams[0].loads) == {0: 1, 1: 1, 2: 1}
    assert all(torch.equal(a, b) for a, b in zip(resident, got))
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
