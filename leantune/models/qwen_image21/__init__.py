"""Qwen-Image-2.1 (7B block-causal single-stream DiT, 32 blocks; Qwen3-VL-8B encoder on the prompt
and up to ten reference images; a 64-channel RGBA VAE): issue 35, under way.

Done so far: the spec (spec.py), the key layouts and architecture from shapes (keys.py), loading
of the diffusers folder and of the official / ComfyUI single files (loading.py), text encoding
equal to QwenImage21Pipeline.encode_prompt (text.py), latents (latents.py), the transformer call
with references and the prefix KV cache (forward.py) and the references' preparation at sampling
(references.py), each tested against the pipeline (tests/test_qwen_image21.py). Not yet: the
ModelFamily object and its registration (so `get_family("qwen_image21")` does not exist yet), LoRA
key maps, the text phase and its pricing, the vision tower streamed block by block (it is
read whole into host RAM when the language model stays in its files), training-time reference
sizes; the family is added to leantune/family_registry.py and tests/families/cases.py only once
the conformance suite passes for it.
"""
