"""dalle-lightning: DALL-E (Ramesh et al., 2021) on PyTorch Lightning."""

__version__ = "0.1.0"
