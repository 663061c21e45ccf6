"""The page's token count for the families that wrap a caption in a chat template (issue 42) is the
count their encode holds against [data] max_text_length: a caption exactly at the limit keeps every
token through the family's own tokenization, one token over loses its end; Qwen-Image-Edit and -2.1
cut nothing, and their count is the rows their encode keeps. Tiny tokenizers (leantune/tiny/),
saved as a model folder's tokenizer is, so the page reads them as it reads a real one; only the
Qwen families run their (tiny) text encoder, for the rows their encode_prompts keeps."""

from __future__ import annotations

import pytest
import torch

from leantune.data.dataset import with_trigger
from leantune.ui import tokens

CAPTION = "a red box on a white table"
TRIGGER = "ohwx"
WHOLE = 512                     # [data] max_text_length's largest value: no caption here reaches it


def _tokenizer(family: str):
    from leantune.tiny import flux2 as tf, qwen_image as tq, z_image as tz

    if family in ("qwen-image", "qwen-image-edit", "krea2", "qwen-image-2.1"):
        return tq.qwen_tokenizer()
    if family == "z-image":
        return tz.z_image_tokenizer()
    return tf.mistral_tokenizer() if family == "flux2-dev" else tf.qwen3_tokenizer()


def _model_folder(tmp_path, family: str, tok):
    """A model folder with only the tokenizer where the family's loader reads it."""
    if family == "qwen-image-2.1":
        from leantune.tiny.qwen_image21 import qwen3_vl_processor

        qwen3_vl_processor(tok).save_pretrained(tmp_path / "processor")   # tokenizer files + chat template
    else:
        tok.save_pretrained(tmp_path / "tokenizer")
    return tmp_path


def _kept(family: str, tok, caption: str, max_length: int) -> tuple[int, bool]:
    """(rows the family's own encode keeps of `caption` at `max_length`, whether they are all of
    the caption's templated tokens), read from the family's tokenization (its input ids and
    attention mask) or, for the Qwen families that tokenize inside encode_prompts, the lengths
    encode_prompts returns with a tiny text encoder."""
    if family == "z-image":
        from leantune.models.z_image import text

        ids, mask = text.tokens(tok, [caption], max_length)
        full = tok(text._templated(tok, [caption]))["input_ids"][0]
        return int(mask.sum()), ids[0][mask[0]].tolist() == full
    if family.startswith("flux2-"):
        from leantune.models.flux2 import text

        cut = text._mistral_tokens if family == "flux2-dev" else text._qwen_tokens
        ids, mask = cut(tok, [caption], max_length)
        full_ids, full_mask = cut(tok, [caption], 4 * WHOLE)
        return int(mask.sum()), ids[0][mask[0].bool()].tolist() == full_ids[0][full_mask[0].bool()].tolist()
    if family == "krea2":
        from leantune.models.krea2 import text

        ids, mask, _ = text.tokens(tok, [caption], max_length)
        full = tok(text.PREFIX + caption)["input_ids"] + tok(text.SUFFIX)["input_ids"]
        return int(mask.sum()) - text.TEMPLATE_DROP, ids[0][mask[0]].tolist() == full
    return _encoded_rows(family, tok, caption, max_length)


def _encoded_rows(family: str, tok, caption: str, max_length: int) -> tuple[int, bool]:
    from leantune.models.family import get_family

    if family == "qwen-image-2.1":
        from leantune.models.qwen_image21.loading import QwenImage21TextEncoders
        from leantune.tiny.qwen_image21 import qwen3_vl_encoder, qwen3_vl_processor

        proc = qwen3_vl_processor(tok)
        tok.chat_template = proc.chat_template
        encoders = QwenImage21TextEncoders(tokenizer=tok, image_processor=proc.image_processor,
                                           text_encoder=qwen3_vl_encoder(tok), device=torch.device("cpu"))
    else:
        from leantune.models.qwen_image.loading import QwenImageTextEncoders
        from leantune.tiny.qwen_image import qwen_text_encoder

        encoders = QwenImageTextEncoders(tokenizer=tok, text_encoder=qwen_text_encoder(tok), device=torch.device("cpu"))
    encode = get_family(family).encode_prompts
    n = int(encode([caption], encoders, max_length=max_length, device="cpu")[1][0])
    whole = int(encode([caption], encoders, max_length=WHOLE, device="cpu")[1][0])
    return n, n == whole


CUT = ["qwen-image", "z-image", "krea2", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b"]


@pytest.mark.parametrize("family", CUT)
def test_a_caption_at_the_limit_is_kept_whole_and_one_token_over_is_cut(tmp_path, family):
    tok = _tokenizer(family)
    folder = _model_folder(tmp_path, family, tok)
    answer = tokens.count([CAPTION], str(folder), family, 10, trigger_word=TRIGGER)
    (n,) = answer["counts"]
    caption = with_trigger(CAPTION, TRIGGER)
    # the count is the trainer's: at n the family's tokenization keeps every token, at n - 1 it cuts
    assert _kept(family, tok, caption, n) == (n, True)
    kept, whole = _kept(family, tok, caption, n - 1)
    assert kept == n - 1 and not whole
    assert answer["cuts"] is True and "come on top" not in answer["note"]
    # the template's tokens are in it: more than the caption's own tokens
    assert n > len(tok(caption, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("family", ["qwen-image-edit", "qwen-image-2.1"])
def test_the_families_that_cut_nothing_count_the_rows_their_encode_keeps(tmp_path, family):
    tok = _tokenizer(family)
    folder = _model_folder(tmp_path, family, tok)
    answer = tokens.count([CAPTION], str(folder), family, 10, trigger_word=TRIGGER)
    (n,) = answer["counts"]
    kept, whole = _encoded_rows(family, tok, with_trigger(CAPTION, TRIGGER), n - 1)
    assert (kept, whole) == (n, True)               # n - 1 as the limit: still every row
    assert answer["cuts"] is False and "reference image" in answer["note"]


def test_a_tokenizer_without_the_template_the_family_applies_says_so(tmp_path):
    """Z-Image applies Qwen3's chat template: a tokenizer/ without one gives no count, and says why;
    the template in a processor's chat_template.json beside the tokenizer files is read."""
    import json

    tok = _tokenizer("z-image")
    template, tok.chat_template = tok.chat_template, None
    tok.save_pretrained(tmp_path / "tokenizer")
    answer = tokens.count([CAPTION], str(tmp_path), "z-image", 10)
    assert answer["counts"] is None and "chat template" in answer["note"]
    (tmp_path / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok.chat_template = template
    (n,) = tokens.count([CAPTION], str(tmp_path), "z-image", 10)["counts"]
    assert _kept("z-image", tok, CAPTION, n) == (n, True)
