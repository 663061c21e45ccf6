"""Benchmark: a text encoder read from its files layer by layer (models/streamed_encoder.py), on the
device it encodes on, against the bytes it moves.

FLUX.2's encoders (Mistral Small 3.x 24B for dev, Qwen3 4B / 8B for klein) are run in the caching
phase straight from their safetensors files when they do not fit the host-RAM budget: each decoder
layer is read (page cache or disk), copied to the device and dropped after its forward. What that
costs per batch of captions is the read and the host->device copy of every layer the encode runs;
on a GPU the question is whether the copy runs near the PCIe rate the planner assumes.

A random Qwen3 text model of the packaged config (`--config qwen3_4b`: klein-4B's; `--layers N`
keeps the first N decoder layers, so the file stays small) is written once to --dir, tensor by
tensor. Then, in this process: one encode of `--batch` captions of `--tokens` tokens each
(output_hidden_states, as the pipelines ask) through `placement(...)` from the files, twice (the
first warms the page cache and the device); reported per run: wall seconds, the bytes read from
the files (resident parts + layers), GB/s of those bytes, and the device's peak allocated bytes.
Beside it, a plain pinned host->device copy of one layer's bytes times the link itself.

    python bench/text_encoder_read.py --device cuda --layers 12          # on a lent GPU
    python bench/text_encoder_read.py --device cpu --layers 2 --tokens 64 # the same path on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write(path: Path, config: dict) -> None:
    """A random Qwen3ForCausalLM of `config` as one safetensors file, tensor by tensor."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from leantune.io import save_safetensors_streamed

    cfg = Qwen3Config(**{k: v for k, v in config.items() if not k.startswith("_")})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    state = model.state_dict()
    layout = [(k, tuple(t.shape), torch.bfloat16) for k, t in state.items()]
    pool = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)

    def chunks():
        for key, shape, dtype in layout:
            n = math.prod(shape)
            flat = torch.empty(n, dtype=dtype)
            for start in range(0, n, pool.numel()):
                m = min(pool.numel(), n - start)
                flat[start:start + m] = pool[:m]
            if key.endswith("norm.weight"):
                flat.fill_(1.0)
            yield {key: flat.view(shape)}

    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors_streamed(path, layout, chunks(), metadata={"note": "random weights, leantune bench"})
    (path.parent / "config.json").write_text(json.dumps(config))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="qwen3_4b", help="a packaged Qwen3 config (leantune/models/configs)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers kept (the file's size)")
    ap.add_argument("--batch", type=int, default=8, help="captions per encode (the cache's TEXT_BATCH)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per caption (FLUX.2 pads to 512)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/leantune-bench-text"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from leantune.models.component_files import packaged_config
    from leantune.models.streamed_encoder import file_backed, placement

    config = dict(packaged_config(a.config))
    config["num_hidden_layers"] = a.layers
    path = a.dir / f"{a.config}-{a.layers}" / "model.safetensors"
    if not path.is_file():
        t0 = time.perf_counter()
        write(path, config)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    device = torch.device(a.device)
    cfg = Qwen3Config(**{k: v for k, v in config.items() if not k.startswith("_")})
    model = file_backed(lambda: Qwen3ForCausalLM(cfg), [path], "model", "layers", torch.bfloat16, "text encoder")
    text = model.model
    read = sum(p.numel() for p in text.parameters()) * 2    # embedding, layers, norm: never the LM head
    layer_bytes = sum(p.numel() for p in text.layers[0].parameters()) * 2
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for run in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with torch.no_grad(), placement(text, text.layers, device):
            out = text(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
            last = out.hidden_states[-1].float().sum().item()        # waits for the device
        secs = time.perf_counter() - t0
        row = {"run": run, "seconds": secs, "bytes_read": read, "read_GBps": read / secs / 1e9,
               "finite": math.isfinite(last)}
        if device.type == "cuda":
            row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del out
    link = None
    if device.type == "cuda":
        host = torch.empty(layer_bytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device=device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        link = 5 * layer_bytes / (time.perf_counter() - t0) / 1e9
        print(f"pinned H2D of one layer ({layer_bytes / 1e6:.0f} MB): {link:.1f} GB/s", flush=True)
    result = {"config": a.config, "layers": a.layers, "batch": a.batch, "tokens": a.tokens, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "layer_bytes": layer_bytes, "pinned_h2d_GBps": link, "runs": rows}
    print(json.dumps(result))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
