"""The error every LoRA reader raises, apart from the readers so each layout's module can raise it
without importing the others (lora_formats reads every layout and calls lora_diffsynth)."""


class LoraFormatError(ValueError):
    """A LoRA file (or LoraWeights) that cannot be read, written or applied; names file and key."""
