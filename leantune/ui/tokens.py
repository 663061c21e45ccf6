"""Each caption's token count against [data] max_text_length, so the page warns when the trainer cuts it.

The trainer tokenizes a caption (its trigger word put before it, data/dataset.py with_trigger) with
the family's long-text tokenizer and keeps at most max_text_length tokens: a caption past that is
cut without a word at training time, and a 3000-character caption typed against a 10-token limit
trained on its first few words. The page counts with the same tokenizer, read from the model
folder (a diffusers folder's tokenizer_2/ for Flux's T5, tokenizer_3/ for SD3.5's T5, tokenizer/
for the others; nothing is downloaded), special tokens included as the family's encoder adds them.
For the families that wrap a caption in a chat template (Qwen-Image, Z-Image, Krea 2, FLUX.2) the
template's few tokens around the caption are not counted, so a caption that many tokens under the
limit may still lose its end; the page says the count is the caption's own.
Without a model folder (a stock name, a single .safetensors file) there is no tokenizer to count
with, and the answer says so instead of guessing.
"""

from __future__ import annotations

import functools
from pathlib import Path

LONG_TEXT_TOKENIZER = {"flux": "tokenizer_2", "sd3": "tokenizer_3"}     # else "tokenizer"
TEMPLATED = ("qwen-image", "qwen-image-edit", "qwen-image-2.1", "z-image", "krea2", "flux2-dev",
             "flux2-klein-4b", "flux2-klein-9b")
MAX_TEXTS = 20_000


def tokenizer_folder(model_path: str, family: str) -> Path | None:
    """The model folder's tokenizer the trainer cuts captions with, or None when it has none."""
    if not model_path.strip():
        return None
    folder = Path(model_path.strip()).expanduser() / LONG_TEXT_TOKENIZER.get(family, "tokenizer")
    return folder if folder.is_dir() else None


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str, mtime_ns: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.model_max_length = 10**9        # counting only: no "longer than the model takes" warning
    return tokenizer


def count(texts: list[str], model_path: str, family: str, limit: int, trigger_word: str = "") -> dict:
    """{"counts": [tokens of each caption as trained, or None without a tokenizer], "limit",
    "tokenizer": the folder counted with (None: none), "note": what the count is, in the page's words}."""
    from ..data.dataset import with_trigger

    if len(texts) > MAX_TEXTS:
        raise ValueError(f"captions: at most {MAX_TEXTS} at once, got {len(texts)}")
    folder = tokenizer_folder(model_path, family)
    if folder is None:
        return {"counts": None, "limit": limit, "tokenizer": None,
                "note": "token counts need the model's folder (its tokenizer); give the Model to see them"}
    try:
        tokenizer = _tokenizer(str(folder), folder.stat().st_mtime_ns)
    except Exception as e:          # transformers raises many kinds for a folder that is no tokenizer
        return {"counts": None, "limit": limit, "tokenizer": None,
                "note": f"token counts: the model's {folder.name}/ folder does not load as a tokenizer ({type(e).__name__})"}
    ids = tokenizer([with_trigger(t, trigger_word) for t in texts], add_special_tokens=True,
                    truncation=False)["input_ids"] if texts else []
    note = f"tokens counted with the model's {folder.name}/, the trigger word included"
    if family in TEMPLATED:
        note += "; the chat template's own tokens come on top"
    return {"counts": [len(i) for i in ids], "limit": limit, "tokenizer": str(folder), "note": note}
