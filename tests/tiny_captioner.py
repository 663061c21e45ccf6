"""A tiny random BLIP image-to-text model built offline (config, BERT vocabulary, image
processor), the stand-in for the captioning models the page points at (BLIP, Florence-2, ...)."""

from __future__ import annotations

from pathlib import Path

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "green", "circle", "square", "triangle",
         "on", "white", "black", "background"]


def save_tiny_blip(folder: Path) -> Path:
    import torch
    from transformers import (BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
                              tokenizer=BertTokenizer(str(folder / "vocab.txt")))
    torch.manual_seed(0)
    config = BlipConfig(text_config=dict(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=37, max_position_embeddings=64,
                                         bos_token_id=2, sep_token_id=3, pad_token_id=0),
                        vision_config=dict(hidden_size=32, image_size=32, patch_size=8, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=37), projection_dim=32)
    BlipForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
