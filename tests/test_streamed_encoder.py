"""Text encoders read from their files layer by layer (models/streamed_encoder.py,
memory/blockwise.blockwise_from_source): the same outputs as the whole encoder, bit for bit, for the
decoder-only and encoder-only text models the families use (Qwen3 for FLUX.2-klein, Mistral3 for
FLUX.2-dev, T5 for Flux/SD3), sharded folders and single files, bf16 and fp8 files; host RAM bounded
by about one layer; a missing tensor is an error naming the file and key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from leantune.models.streamed_encoder import encoder_files, file_backed, is_file_backed, placement
from leantune.models.weights import LoadError

FLUX2_LAYERS = (1, 2, 3)      # hidden states the pipelines stack (FLUX.2: (10, 20, 30) / (9, 18, 27))


def qwen3(layers=3, width=32, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval(), lambda: Qwen3ForCausalLM(cfg)


def mistral3(layers=3, seed=0):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, head_dim=8, image_size=32, patch_size=8))
    return Mistral3ForConditionalGeneration(cfg).eval(), lambda: Mistral3ForConditionalGeneration(cfg)


def t5(layers=3, seed=0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    return T5EncoderModel(cfg).eval(), lambda: T5EncoderModel(cfg)


def save_shards(state: dict, folder: Path, shards: int = 2, rename=lambda k: k) -> Path:
    """A transformers-style sharded folder: model-0000i-of-0000n.safetensors and its index."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {rename(k): state[k].contiguous() for k in keys[i::shards]}
        save_file(part, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stacked(text_model, ids, mask):
    """The FLUX.2 pipelines' prompt embeddings: chosen hidden states stacked along the width."""
    out = text_model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    h = torch.stack([out.hidden_states[k] for k in FLUX2_LAYERS], dim=1)       # (B, 3, L, D)
    return h.permute(0, 2, 1, 3).reshape(h.shape[0], h.shape[2], -1)


IDS = torch.tensor([[5, 9, 11, 3, 0, 0], [7, 8, 2, 4, 6, 1]])
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


@torch.no_grad()
def test_qwen3_from_sharded_folder_equals_whole_encoder(tmp_path):
    whole, factory = qwen3()
    expected = stacked(whole.model, IDS, MASK)
    folder = save_shards(state_of(whole), tmp_path / "text_encoder")
    lazy = file_backed(factory, encoder_files(folder), "model", "layers", torch.float32, "text encoder")
    assert is_file_backed(lazy.model)
    assert all(p.device.type == "meta" for p in lazy.parameters())        # nothing read yet
    with placement(lazy.model, lazy.model.layers, "cpu"):
        got = stacked(lazy.model, IDS, MASK)
    assert torch.equal(got, expected)
    assert all(p.device.type == "meta" for p in lazy.parameters())        # nothing kept after


@torch.no_grad()
@pytest.mark.parametrize("old_layout", [False, True])
def test_mistral3_language_model_equals_whole(tmp_path, old_layout):
    """Mistral3's text model under transformers' current keys and under the older
    `language_model.model.` layout of hub checkpoints: the prefix is found from the headers."""
    whole, factory = mistral3()
    lm = whole.model.language_model
    expected = stacked(lm, IDS, MASK)
    rename = (lambda k: k.replace("model.language_model.", "language_model.model.")) if old_layout else (lambda k: k)
    folder = save_shards(state_of(whole), tmp_path / "te", shards=3, rename=rename)
    lazy = file_backed(factory, encoder_files(folder), "model.language_model", "layers", torch.float32, "text encoder")
    text = lazy.model.language_model
    with placement(text, text.layers, "cpu"):
        got = stacked(text, IDS, MASK)
    assert torch.equal(got, expected)


@torch.no_grad()
def test_t5_single_file_with_tied_embedding_equals_whole(tmp_path):
    whole, factory = t5()
    expected = whole(input_ids=IDS, attention_mask=MASK).last_hidden_state
    state = state_of(whole)
    state.pop("encoder.embed_tokens.weight", None)       # tied to shared.weight, stored once
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "t5.safetensors")
    lazy = file_backed(factory, encoder_files(tmp_path / "t5.safetensors"), "", "encoder.block", torch.float32, "T5")
    with placement(lazy, lazy.encoder.block, "cpu"):
        got = lazy(input_ids=IDS, attention_mask=MASK).last_hidden_state
    assert torch.equal(got, expected)


@torch.no_grad()
@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_file_dequantised_per_layer_equals_dequantised_whole(tmp_path, scaled):
    """An e4m3 file (plain, or ComfyUI-scaled with a per-tensor scale_weight): every layer's
    weights dequantised on the device equal the whole encoder built from the same dequantised
    weights."""
    whole, factory = qwen3()
    state, stored = state_of(whole), {}
    for k, v in state.items():
        if v.dim() == 2 and "layers." in k:
            scale = v.abs().max() / 448 if scaled else torch.tensor(1.0)
            q = (v / scale).to(torch.float8_e4m3fn)
            stored[k] = q
            if scaled:
                stored[k[: -len("weight")] + "scale_weight"] = scale.reshape(1).float()
            state[k] = q.to(torch.float32) * scale
        else:
            stored[k] = v
    whole.load_state_dict(state)
    expected = stacked(whole.model, IDS, MASK)
    save_file({k: v.contiguous() for k, v in stored.items()}, tmp_path / "te_fp8.safetensors")
    lazy = file_backed(factory, [tmp_path / "te_fp8.safetensors"], "model", "layers", torch.float32, "text encoder")
    with placement(lazy.model, lazy.model.layers, "cpu"):
        got = stacked(lazy.model, IDS, MASK)
    assert torch.equal(got, expected)


@torch.no_grad()
def test_fp8_weight_read_in_bf16_rounds_the_fp32_product_once(tmp_path):
    """Issue 40, finding 10: a scaled e4m3 weight read for a bf16 encoder is formed in the bf16
    weight itself (no fp32 temporary on the device) and must carry the bits of the fp32 product
    rounded once to bf16, every layer's every weight."""
    from leantune.models.streamed_encoder import FileSource
    from leantune.models.weights import CheckpointFiles

    whole, factory = qwen3()
    stored, want = {}, {}
    for k, v in state_of(whole).items():
        if v.dim() == 2 and "layers." in k:
            scale = v.abs().max() / 448
            q = (v / scale).to(torch.float8_e4m3fn)
            stored[k], stored[k[: -len("weight")] + "scale_weight"] = q, scale.reshape(1).float()
            want[k] = (q.float() * scale).to(torch.bfloat16)
        else:
            stored[k] = v
    save_file({k: v.contiguous() for k, v in stored.items()}, tmp_path / "te_fp8.safetensors")
    with CheckpointFiles([tmp_path / "te_fp8.safetensors"]) as files:
        read = FileSource(files, "", torch.bfloat16, factory(), {}).reader(torch.device("cpu"))
        for k, w in want.items():
            got = read(k, None)
            assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), w.view(torch.int16)), k
    assert len(want) >= 14


def test_missing_or_misshapen_tensor_names_file_and_key(tmp_path):
    whole, factory = qwen3()
    state = state_of(whole)
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "te.safetensors")
    with pytest.raises(LoadError, match=r"te\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        file_backed(factory, [tmp_path / "te.safetensors"], "model", "layers", torch.float32, "text encoder")
    state = state_of(whole)
    state["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "te2.safetensors")
    with pytest.raises(LoadError, match=r"te2\.safetensors.*model\.layers\.2\.self_attn\.q_proj\.weight.*shape"):
        file_backed(factory, [tmp_path / "te2.safetensors"], "model", "layers", torch.float32, "text encoder")


WORKER = textwrap.dedent("""
    import sys, torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from leantune.models.streamed_encoder import encoder_files, file_backed, placement

    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    cfg = Qwen3Config(vocab_size=64, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    factory = lambda: Qwen3ForCausalLM(cfg)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.set_num_threads(1)
    with torch.no_grad():
        if sys.argv[2] == "files":
            model = file_backed(factory, encoder_files(sys.argv[1]), "model", "layers", torch.float32, "te")
            ctx = placement(model.model, model.model.layers, "cpu")
        else:
            from leantune.models.weights import CheckpointFiles
            import contextlib
            model = Qwen3ForCausalLM(cfg)
            ctx = contextlib.nullcontext()
        peak = [0]
        for layer in model.model.layers:
            layer.register_forward_hook(lambda *_: peak.__setitem__(0, max(peak[0], rss_anon())))
        base = rss_anon()
        with ctx:
            model.model(input_ids=ids, use_cache=False)
    print(base, peak[0])
""")


def test_host_ram_bounded_by_about_one_layer(tmp_path):
    """A Qwen3 of 8 layers of 50 MB each (fp32), encoded from its files in a fresh process: its
    anonymous RSS, sampled after every layer's forward (when that layer is resident), grows by
    less than two layers over its start, where the same model held whole grows by all eight."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    model = Qwen3ForCausalLM(cfg)
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    save_shards(state_of(model), tmp_path / "te", shards=2)
    del model
    # glibc's mmap threshold pinned: freed tensors go back to the kernel at once, so RssAnon follows
    # the live tensors rather than the allocator's caching of freed blocks
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": str(2**20)}

    def run(kind):
        out = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "te"), kind], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        base, peak = map(int, out.stdout.split()[-2:])
        return base, peak

    base, peak = run("files")
    assert peak - base < 2 * layer_bytes, (peak - base) / layer_bytes
    whole_base, whole_peak = run("whole")
    # the whole model was built before `base` was read: its layers are all in the baseline
    assert whole_base > base + 6 * layer_bytes
