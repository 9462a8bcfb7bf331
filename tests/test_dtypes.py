"""Every dtype knob reads names the same way (``dalle_lightning_plugins.dtypes``)."""

from __future__ import annotations

import pytest
import torch

from dalle_lightning_plugins.compression.comm_dtype import resolve_comm_dtype
from dalle_lightning_plugins.dtypes import dtype_name, resolve_dtype
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [("fp16", torch.float16), ("BF16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float32", torch.float32),
     ("fp32", torch.float32), ("float64", torch.float64), (torch.float16, torch.float16)],
)
def test_short_and_torch_names_resolve_alike(spec: str | torch.dtype, dtype: torch.dtype) -> None:
    assert resolve_dtype(spec) is dtype


def test_none_passes_and_unknown_names_fail_naming_the_knob() -> None:
    assert resolve_dtype(None) is None
    with pytest.raises(ValueError, match="param_dtype='fp17'"):
        resolve_dtype("fp17", what="param_dtype")
    with pytest.raises(ValueError, match=r"comm_dtype='int8' is not supported; expected one of \['bf16', 'fp16', 'fp32'\]"):
        resolve_comm_dtype("int8")


def test_every_knob_accepts_every_spelling() -> None:
    assert resolve_comm_dtype("bfloat16") is resolve_comm_dtype("bf16") is torch.bfloat16
    assert ResblockScalingPrecision("bfloat16").dtype is ResblockScalingPrecision("bf16").dtype is torch.bfloat16
    assert ResblockScalingPrecision(torch.float16).precision == "16-mixed"
    with pytest.raises(ValueError, match="dtype='fp32'"):
        ResblockScalingPrecision("fp32")


def test_names_round_trip() -> None:
    assert [dtype_name(d) for d in (torch.bfloat16, torch.float32, torch.int8)] == ["bf16", "fp32", "int8"]
