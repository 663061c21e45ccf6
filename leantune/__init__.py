"""leantune: fine-tune and sample large diffusion transformers on the memory you have."""
__version__ = "0.1.0"
