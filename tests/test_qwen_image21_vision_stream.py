"""Qwen-Image-2.1's vision tower streamed unit by unit in the encoding phase (issue 35), and priced so.

On a device, text.encode_prompts places the Qwen3-VL vision tower as it places the language model
(streamed_encoder.placement: a module in host RAM runs with its blocks brought one at a time,
memory/blockwise.py). On the CPU `placement` leaves a host module where it is (there is no device
to save), so these tests stand in for a GPU by making `placement` stream on the CPU exactly as it
streams onto a device: the same blockwise_offload, the same hooks, the same evicted placeholders.
What they check: the tower is handed to placement with its units (every block, every deepstack
merger, the final merger) in the order its forward runs them; while a unit runs no other unit
holds weights; the encodings equal the whole tower's bit for bit; the sampler's stage moves no
part of it whole; the caching phase's price holds the streamed tower, not the whole one, and grows
with each caption's reference count by the per-reference bytes counted by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from leantune.models.qwen_image21 import loading, text
from leantune.tiny import qwen_image21 as tq

PROMPTS = ["a photo of a cat", "a small orange ellipse next to a large purple square"]
# A deeper tiny tower than the preset's one block: three blocks with deepstack mergers after the
# first and the last, so the units interleave blocks and mergers as the 8B's do ([8, 16, 24] of 27).
VISION = dict(tq.QWEN3_VL_VISION_TINY, depth=3, deepstack_visual_indexes=[0, 2])


def _image(seed: int, size) -> Image.Image:
    rng = np.random.RandomState(seed)
    pixels = (rng.rand(size[1], size[0], 4) * 255).astype(np.uint8)
    pixels[:, : size[0] // 2, 3] = 0
    return Image.fromarray(pixels, "RGBA")


@pytest.fixture(scope="module")
def encoders():
    """A tiny Qwen3-VL (tq's text model, the deeper tower above) with the tiny processor's parts,
    as loading.load_text_encoders returns them."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from leantune.tiny.qwen_image import _token_id

    processor = tq.qwen3_vl_processor()
    tok = processor.tokenizer
    if getattr(tok, "chat_template", None) is None:
        tok.chat_template = tq.QWEN3_VL_TEMPLATE
    pad = _token_id(tok, "<|endoftext|>")
    cfg = Qwen3VLConfig(
        text_config=dict(tq.QWEN3_VL_TEXT_TINY, vocab_size=len(tok), bos_token_id=pad,
                         eos_token_id=_token_id(tok, "<|im_end|>"), pad_token_id=pad),
        vision_config=dict(VISION),
        image_token_id=_token_id(tok, "<|image_pad|>"), video_token_id=_token_id(tok, "<|video_pad|>"),
        vision_start_token_id=_token_id(tok, "<|vision_start|>"),
        vision_end_token_id=_token_id(tok, "<|vision_end|>"))
    torch.manual_seed(5)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():          # biases and norms away from their zero / one inits, so a lost tensor shows
        for name, p in model.model.visual.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return loading.QwenImage21TextEncoders(tokenizer=tok, image_processor=processor.image_processor,
                                           text_encoder=model, device=torch.device("cpu"))


@pytest.fixture
def as_on_a_device(monkeypatch):
    """A call that makes streamed_encoder.placement stream a host module on the CPU as it streams
    it onto a device, from then on in the test; it returns the (module, blocks) pairs placement
    is asked to place."""
    from leantune.memory.blockwise import blockwise_offload
    from leantune.models import streamed_encoder

    def start() -> list:
        asked = []

        def placement(module, blocks, device):
            asked.append((module, blocks))
            return blockwise_offload(module, blocks, "cpu")

        monkeypatch.setattr(streamed_encoder, "placement", placement)
        return asked

    return start


def _residency(units):
    """Forward hooks recording, as each unit's forward ends, its index and which units hold weights
    (registered before the streaming's own hooks, they run before it drops the unit)."""
    seen = []

    def hook(i):
        def post(module, args, output):
            seen.append((i, [sum(p.numel() for p in u.parameters()) > 0 for u in units]))
        return post

    return seen, [u.register_forward_hook(hook(i)) for i, u in enumerate(units)]


def test_the_units_are_every_block_and_merger_in_the_order_the_tower_runs_them(encoders):
    visual = encoders.text_encoder.model.visual
    units = text.vision_units(visual)
    assert units is text.vision_units(visual)        # one list per tower: a lock-step pass shares it by identity
    b, ds = visual.blocks, visual.deepstack_merger_list
    assert list(units) == [b[0], ds[0], b[1], b[2], ds[1], visual.merger]
    # only the patch embedding and the position table stay outside the units
    inside = {id(p) for u in units for p in u.parameters()}
    outside = {n.split(".")[0] for n, p in visual.named_parameters() if id(p) not in inside}
    assert outside == {"patch_embed", "pos_embed"}


def test_the_tower_is_streamed_unit_by_unit_and_encodes_the_same_bits(encoders, as_on_a_device):
    """Two prompts with two RGBA references of different sizes: the tower is placed with its
    units, each unit runs alone on its weights in the forward's order, and the rows and slot
    masks equal the whole tower's bit for bit; its weights are back, the same storages, after.
    Prompts without references do not place the tower at all."""
    visual = encoders.text_encoder.model.visual
    refs = [_image(1, (64, 64)), _image(2, (96, 64))]
    want = text.encode_prompts(PROMPTS, encoders, images=refs)        # on the CPU: the tower whole, in place
    before = {n: p.data_ptr() for n, p in visual.named_parameters()}
    asked = as_on_a_device()

    units = text.vision_units(visual)
    seen, handles = _residency(units)
    try:
        got = text.encode_prompts(PROMPTS, encoders, images=refs)
    finally:
        for h in handles:
            h.remove()
    placed = {id(m): blocks for m, blocks in asked}
    assert placed.get(id(visual)) is units
    assert [i for i, _ in seen] == list(range(len(units)))
    for i, holding in seen:
        assert holding[i] and not any(h for j, h in enumerate(holding) if j != i), (i, holding)
    for a, b in zip(got, want):
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.image_slots, b.image_slots)
    assert int(got[0].image_slots.sum()) == 2 * 2 + 3 * 2          # 32-pixel slots of both references
    assert {n: p.data_ptr() for n, p in visual.named_parameters()} == before

    asked.clear()
    text.encode_prompts(PROMPTS, encoders)
    assert [m for m, _ in asked] == [encoders.text_encoder.model.language_model]


def test_the_samplers_encode_stage_moves_no_part_of_the_tower_whole(encoders, as_on_a_device):
    """infer/encode.py moves a family's `whole` modules to the device before encoding: the tower is
    none of them (nor is it inside one), and through the stage it streams unit by unit."""
    from leantune.infer.encode import encode_prompts_stage
    from leantune.models.family import get_family

    family = get_family("qwen-image-2.1")
    visual = encoders.text_encoder.model.visual
    whole, streamable = family.text_modules(encoders)
    moved = {id(p) for m in whole for p in m.parameters()}
    assert not moved & {id(p) for p in visual.parameters()}
    assert streamable is encoders.text_encoder.model.language_model

    asked = as_on_a_device()
    units = text.vision_units(visual)
    seen, handles = _residency(units)
    try:
        encode_prompts_stage(encoders, PROMPTS[:1], max_length=64, device="cpu", family=family,
                             images=[_image(3, (64, 64))])
    finally:
        for h in handles:
            h.remove()
    assert any(m is visual for m, _ in asked)
    assert seen and all(sum(holding) == 1 and holding[i] for i, holding in seen)


def test_the_caching_phase_prices_the_streamed_tower_per_caption_with_its_references():
    """text_phase.text_encoding_phase for Qwen3-VL-8B (the packaged config): the tower's device
    weights are its resident parts (patch embedding, position table) and the two largest
    consecutive units (a block and a deepstack merger), counted by hand from the config, not the
    whole tower; each further reference adds exactly its patches' bytes (pixels, the busiest
    block's activations, the running stream, its merged and deepstack outputs) to the tower's
    run, and its tokens and tags to the caption's language-model run; the phase's peak is the
    largest of the plain batch, the caption's language-model run and the tower's run beside the
    language model's resident parts."""
    from leantune.models.component_files import packaged_config
    from leantune.models.qwen_image21.references import TAG_ROWS
    from leantune.models.qwen_image21.text_phase import text_encoding_phase

    v = packaged_config("qwen3_vl_8b")["vision_config"]
    d, i, out, m = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v["spatial_merge_size"]
    embed = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * d + d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d)
    merged = d * m * m
    deepstack = 2 * merged + (merged * merged + merged) + (merged * out + out)
    final = 2 * d + (merged * merged + merged) + (merged * out + out)
    whole = embed + v["num_position_embeddings"] * d + v["depth"] * block + final + \
        len(v["deepstack_visual_indexes"]) * deepstack
    resident = embed + v["num_position_embeddings"] * d

    phases = {n: text_encoding_phase(references=n) for n in (0, 1, 3)}
    assert "vision" not in phases[0]
    patches = (1024 // v["patch_size"]) ** 2
    tokens = patches // (m * m)
    per_reference = (patches * v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
                     + 6 * patches * d + 2 * patches * i + patches * d
                     + tokens * out * (1 + len(v["deepstack_visual_indexes"]))) * 2
    for n in (1, 3):
        phase, vision = phases[n], phases[n]["vision"]
        assert vision["weights"] == whole * 2
        assert vision["streamed_weights"] == (resident + block + deepstack) * 2 < vision["weights"] / 9
        assert vision["held_after"] == (resident + final) * 2
        assert vision["units"] == v["depth"] + len(v["deepstack_visual_indexes"]) + 1
        assert phase["edit"]["tokens"] == 528 + n * (tokens + TAG_ROWS)
        plain = phases[0]["device"] + vision["held_after"]
        assert phase["device"] == max(plain, phase["edit"]["device"], phase["edit"]["tower_device"])
        lm = phases[0]
        assert phase["edit"]["tower_device"] == vision["device"] + lm["resident"] + lm["layer"]
    assert phases[3]["vision"]["device"] - phases[1]["vision"]["device"] == 2 * per_reference
    assert phases[3]["edit"]["device"] > phases[1]["edit"]["device"]
    assert phases[3]["device"] > phases[1]["device"]


def test_a_lock_step_pass_moves_each_tower_unit_once_for_all_its_captions(encoders, as_on_a_device):
    """The cache's text pass (memory/lockstep.py, data/cache.py) runs its captions layer-major: two
    captions with their references, each a lane, go through each tower unit together (one move per
    unit for the pass, not one per caption) and then through the language model's layers, in one
    pass over both streams; each caption's rows equal its encoding alone with the whole tower."""
    from leantune.memory.lockstep import run_pass

    refs = [_image(4, (64, 64)), _image(5, (64, 96))]
    want = [text.encode_prompts([p], encoders, images=refs)[0] for p in PROMPTS]
    as_on_a_device()
    units = text.vision_units(encoders.text_encoder.model.visual)
    moves: list = []
    got = run_pass([lambda p=p: text.encode_prompts([p], encoders, images=refs)[0] for p in PROMPTS],
                   report=moves.extend)
    tower = [i for stream, i in moves if stream.blocks[0] is units[0]]
    assert tower == list(range(len(units)))
    layers = [i for stream, i in moves if stream.blocks[0] is not units[0]]
    assert layers == list(range(len(encoders.text_encoder.model.language_model.layers)))
    for a, b in zip(got, want):
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.image_slots, b.image_slots)
