"""Whether a device computes bf16 natively, so the default precision can follow the hardware.

bf16 autocast is the fast choice only where the hardware has bf16 arithmetic: CUDA devices that report it, and CPUs
whose oneDNN bf16 kernels run on AVX512 (with or without its BF16 extension and AMX) or on Arm's BF16 extension. On a
CPU with AVX2 only, oneDNN falls back to a reference path: on a 2-core AVX2 machine a 1024 x 1024 matrix product
took 2.3 s in bf16 against 18 ms in fp32 (``benchmarks/matmul_dtypes.py``), so a bf16 default would make every
stage two orders of magnitude slower there. ``precision=auto`` (the default of ``dalle-train``), ``bf16=auto``
(``dalle-encode``) and ``dtype=auto`` (``dalle-generate``, on a GPU) resolve through :func:`native_bf16`.
"""

from __future__ import annotations

import functools

import torch

AUTO = "auto"
SIXTEEN_BIT = ("fp16", "bf16", "float16", "bfloat16", "half")  # dtype names a precision plugin may be given


@functools.cache
def native_bf16(accelerator: str = "cpu") -> bool:
    """True where bf16 matrix products run at least as fast as fp32 on ``accelerator`` (cpu, cuda/gpu, or auto:
    CUDA when one is visible)."""
    if accelerator not in ("cpu", "cuda", "gpu", AUTO):
        raise ValueError(f"accelerator={accelerator!r}; expected cpu, cuda, gpu or auto")
    if accelerator in ("cuda", "gpu") or (accelerator == AUTO and torch.cuda.is_available()):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None:
        return bool(probe())
    return bool(torch.cpu._is_avx512_bf16_supported())  # pragma: no cover - older builds without the oneDNN probe


def auto_precision(accelerator: str = "cpu") -> str:
    """The Lightning precision name ``precision=auto`` stands for: ``bf16-mixed`` where bf16 is native, else
    ``32-true`` (fp32 beats a bf16 that is emulated)."""
    return "bf16-mixed" if native_bf16(accelerator) else "32-true"


def auto_sampling_dtype(device: str) -> str:
    """The compute dtype ``dtype=auto`` of ``dalle-generate`` stands for on ``device`` (``cpu``, ``cuda``,
    ``cuda:N``): ``bf16`` on a GPU that computes it natively, as ``precision=auto`` decides, else ``fp32``. On a CPU
    it stays fp32 even where bf16 is native, so that a seed draws the same images on every CPU (which CPUs have
    bf16 varies); ``dtype=bf16`` asks for it there."""
    return "bf16" if device.startswith("cuda") and native_bf16("cuda") else "fp32"


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` where a CUDA device is visible, else ``cpu``; any other name unchanged (the commands'
    ``device`` option, checked by ``dalle_lightning.cli.checks.device``)."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
