"""The README's first command, end to end: `leantune demo` trains on a tiny Flux built offline."""

import json

from PIL import Image

from leantune.cli import main


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    run = out / "run"
    lora_files = sorted(run.glob("shapes-lora_*.safetensors"))
    assert [f.name for f in lora_files] == ["shapes-lora_comfyui.safetensors", "shapes-lora_diffusers.safetensors"]
    for f in lora_files:
        assert str(f) in printed
    # The loss must visibly fall: last tenth of the run well below the first tenth.
    losses = json.loads((run / "loss.json").read_text())["loss"]
    n = len(losses) // 10
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    assert last < 0.8 * first, (first, last)
    # A sample grid per sampling step, real PNGs, a loss plot, a TensorBoard log.
    grids = sorted((run / "samples").glob("step-*.png"))
    assert grids and Image.open(grids[-1]).size == (256, 128)   # 2 prompts of 128x128 side by side
    from leantune.infer.images import read_png_metadata

    meta = read_png_metadata(grids[-1])
    assert json.loads(meta["prompt"])[0].startswith("lnt, a red circle") and meta["training_step"] == "400"
    assert Image.open(run / "loss.png").format == "PNG"
    # Before/after: the base model and the trained LoRA on the same prompts and seeds, side by side.
    from leantune.demo import before_after_match

    pair = Image.open(run / "samples" / "before-after.png")
    assert pair.size == (2 * 128 + 4, 2 * 128 + 4)              # 2 prompts x (before, after), 4 px apart
    prompts = json.loads(meta["prompt"])
    match = before_after_match(run / "samples", prompts)
    assert len(match["before"]) == len(match["after"]) == 2
    assert "before -> after" in printed
    # The trained model draws the prompted background colour far more often than the base model
    # (measured: 2% -> 17% of pixels, mean over the two prompts; the shapes are not yet learned).
    before_bg = sum(bg for _, bg in match["before"]) / 2
    after_bg = sum(bg for _, bg in match["after"]) / 2
    assert after_bg > 3 * before_bg and after_bg > 0.1, match
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # The LoRA loads back into diffusers and changes the model's output.
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(out / "model")
    kwargs = dict(prompt="lnt, a red circle on a white background", height=64, width=64, num_inference_steps=2,
                  max_sequence_length=32, output_type="pt", generator=torch.Generator().manual_seed(0))
    before = pipe(**kwargs).images
    pipe.load_lora_weights(str(run / "shapes-lora_diffusers.safetensors"))
    kwargs["generator"] = torch.Generator().manual_seed(0)
    after = pipe(**kwargs).images
    assert (after - before).abs().max() > 1e-3
