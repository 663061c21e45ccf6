"""A diffusers-format LoRA trained with alpha != rank loads at its trained strength everywhere.

ComfyUI reads a module's alpha only from a `<module>.alpha` tensor, never from the file header
where the diffusers layout keeps it (`lora_adapter_metadata`); without the tensor it scales by 1,
so a file relying on the header loaded at rank / alpha of its strength. `comfyui_merge` below is
written from that documented behaviour (comfy/lora.py: `alpha = state_dict[alpha_key] / rank` if
the key exists, else 1.0; delta = alpha * up @ down), independently of leantune's own readers.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from leantune import tiny
from leantune.models.flux import FLUX_SPEC
from leantune.config import LoraConfig
from leantune.train.lora import add_lora, lora_layers, lora_weights_from_model, read_lora, save_lora

UP_SUFFIXES = (".lora_B.weight", ".lora_up.weight")


def comfyui_merge(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{module key prefix: weight delta} as ComfyUI's LoRA loader computes it at strength 1."""
    out = {}
    for key, up in tensors.items():
        suffix = next((s for s in UP_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        prefix = key[: -len(suffix)]
        down = tensors[prefix + (".lora_A.weight" if suffix == ".lora_B.weight" else ".lora_down.weight")]
        alpha_key = prefix + ".alpha"
        scale = tensors[alpha_key].item() / down.shape[0] if alpha_key in tensors else 1.0
        out[prefix] = scale * (up.float() @ down.float())
    return out


def _trained(rank, alpha, seed=11):
    tr = tiny.flux_transformer(seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in add_lora(tr, FLUX_SPEC, LoraConfig(rank=rank, alpha=alpha, targets="attention")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tr


@pytest.mark.parametrize("rank,alpha", [(4, 8.0), (4, 1.0), (4, 3.0), (4, 4.0)])
def test_diffusers_file_merges_at_the_trained_strength_as_comfyui_does(tmp_path, rank, alpha):
    w = lora_weights_from_model(_trained(rank, alpha))
    path = save_lora(w, tmp_path / "style.safetensors", "diffusers")
    merged = comfyui_merge(load_file(path))
    assert set(merged) == {f"transformer.{n}" for n in w.modules}
    for name, m in w.modules.items():
        torch.testing.assert_close(merged[f"transformer.{name}"], m.delta(), rtol=1e-5, atol=1e-7)
    # leantune reads back the trained alpha (init_from continues with the same scale) and delta.
    back = read_lora(path)
    for name, m in w.modules.items():
        assert back.modules[name].alpha == alpha and back.modules[name].rank == rank
        torch.testing.assert_close(back.modules[name].delta(), m.delta(), rtol=1e-5, atol=1e-7)


def test_diffusers_file_loads_in_diffusers_at_the_trained_strength(tmp_path):
    from diffusers import FluxPipeline

    w = lora_weights_from_model(_trained(4, 3.0))
    path = save_lora(w, tmp_path / "style.safetensors", "diffusers")
    comps = tiny.flux_components(seed=0)
    comps["transformer"] = tiny.flux_transformer(seed=0)
    pipe = FluxPipeline(**comps)
    pipe.load_lora_weights(str(path), adapter_name="style")
    layers = lora_layers(pipe.transformer, "style")
    assert set(layers) == set(w.modules)
    for name, layer in layers.items():
        delta = layer.scaling["style"] * (layer.lora_B["style"].weight @ layer.lora_A["style"].weight)
        torch.testing.assert_close(delta.detach(), w.modules[name].delta(), rtol=1e-5, atol=1e-7)
