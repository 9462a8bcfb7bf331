"""dalle-lightning: DALL-E (Ramesh et al., 2021) on PyTorch Lightning."""

from importlib import metadata as _metadata

# One version for both distributions: strategies/VERSION, read by both pyproject.toml files.
try:
    __version__ = _metadata.version("dalle-lightning")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
