"""Each caption's token count against [data] max_text_length, so the page warns when the trainer cuts it.

The trainer tokenizes a caption (its trigger word put before it, data/dataset.py with_trigger) with
the family's long-text tokenizer and keeps at most max_text_length tokens: a caption past that is
cut without a word at training time, and a 3000-character caption typed against a 10-token limit
trained on its first few words. The page counts with the same tokenizer, read from the model
folder (a diffusers folder's tokenizer_2/ for Flux's T5, tokenizer_3/ for SD3.5's T5, tokenizer/
for the others; nothing is downloaded), special tokens included as the family's encoder adds them.
For the families that wrap a caption in a chat template (Qwen-Image, Z-Image, Krea 2, FLUX.2) the
count is the family's own (ModelFamily.caption_tokens): the tokens its encode holds against
max_text_length, template included where the template counts (Z-Image, FLUX.2) and past the dropped
system part where it does not (Qwen-Image, Krea 2), so a caption at the limit is kept whole and one
token over loses its end. Qwen-Image-Edit and -2.1 cut nothing (ModelFamily.cuts_text): their count
is the rows the caption gives, and what references add (their image tokens, which depend on each
reference's size) comes on top.
Without a model folder (a stock name, a single .safetensors file) there is no tokenizer to count
with, and the answer says so instead of guessing.
"""

from __future__ import annotations

import functools
from pathlib import Path

# Qwen-Image-2.1's tokenizer and chat template live in its processor/ (qwen_image21/loading.py)
LONG_TEXT_TOKENIZER = {"flux": "tokenizer_2", "sd3": "tokenizer_3", "qwen-image-2.1": "processor"}  # else "tokenizer"
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
    if getattr(tokenizer, "chat_template", None) is None:
        # a processor folder keeps the template beside the tokenizer files (Qwen-Image-2.1's processor/,
        # as qwen_image21/loading.py reads it; FLUX.2-dev's Pixtral processor in tokenizer/)
        jinja, as_json = Path(folder) / "chat_template.jinja", Path(folder) / "chat_template.json"
        if jinja.is_file():
            tokenizer.chat_template = jinja.read_text(encoding="utf-8")
        elif as_json.is_file():
            import json

            tokenizer.chat_template = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    return tokenizer


def _family(name: str):
    """The registered family of `name`, or None for a name the form does not know (yet)."""
    from ..models.family import get_family

    try:
        return get_family(name)
    except (KeyError, ValueError):
        return None


def count(texts: list[str], model_path: str, family: str, limit: int, trigger_word: str = "") -> dict:
    """{"counts": [tokens of each caption as trained, or None without a tokenizer], "limit",
    "tokenizer": the folder counted with (None: none), "note": what the count is, in the page's words,
    "cuts": whether the trainer cuts a caption past the limit (False: the family keeps every row)}."""
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
    captions = [with_trigger(t, trigger_word) for t in texts]
    family_obj = _family(family)
    counter = family_obj.caption_tokens if family_obj is not None else None
    if not captions:
        counts = []
    elif counter is not None:
        try:
            counts = counter(tokenizer, captions)
        except Exception as e:      # a tokenizer without the chat template the family applies, most often
            return {"counts": None, "limit": limit, "tokenizer": None,
                    "note": f"token counts: the model's {folder.name}/ does not apply this model's chat template "
                            f"({type(e).__name__}: {str(e)[:120]})"}
    else:
        counts = [len(i) for i in tokenizer(captions, add_special_tokens=True, truncation=False)["input_ids"]]
    cuts = family_obj is None or family_obj.cuts_text
    note = f"tokens counted with the model's {folder.name}/, the trigger word included"
    if counter is not None:
        note += ", the chat template's tokens as the trainer counts them"
    if not cuts:
        note += ("; this model's trainer cuts no caption (Text tokens is the length the plan prices), "
                 "and each reference image adds its image tokens on top")
    return {"counts": counts, "limit": limit, "tokenizer": str(folder), "note": note, "cuts": cuts}
