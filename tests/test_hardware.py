"""``precision=auto`` and ``bf16=auto`` follow the hardware: bf16 where it is native, fp32 where it is emulated."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dalle_lightning import hardware
from dalle_lightning.cli.common import strategy_and_precision


def _cfg(precision: str, accelerator: str = "cpu"):
    return OmegaConf.create({"strategy": {"name": "auto"}, "precision": {"name": precision},
                             "trainer": {"accelerator": accelerator}})


def test_cpu_verdict_is_onednn_s_own() -> None:
    """The CPU verdict is oneDNN's: its bf16 kernels are native on AVX512 / Arm BF16 and a slow reference on AVX2."""
    assert hardware.native_bf16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert hardware.auto_precision("cpu") == ("bf16-mixed" if hardware.native_bf16("cpu") else "32-true")


@pytest.mark.parametrize("native, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_resolves_to_the_fast_format(monkeypatch: pytest.MonkeyPatch, native: bool, expected: str) -> None:
    monkeypatch.setattr(hardware, "native_bf16", lambda accelerator="cpu": native)
    assert strategy_and_precision(_cfg("auto"))["precision"] == expected
    # a name the user picked is passed through untouched, whatever the hardware
    assert strategy_and_precision(_cfg("bf16-mixed"))["precision"] == "bf16-mixed"
    assert strategy_and_precision(_cfg("32-true"))["precision"] == "32-true"


def test_a_cuda_request_without_cuda_is_not_native() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert hardware.native_bf16("gpu") is False


def test_unknown_accelerator_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="accelerator='tpu'; expected cpu, cuda, gpu or auto"):
        hardware.native_bf16("tpu")


@pytest.mark.parametrize("native", [True, False])
def test_a_16_bit_choice_on_emulating_hardware_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                     native: bool) -> None:
    """bf16-mixed (or the per-resblock plugin in bf16) picked by hand on a CPU that emulates it: one warning."""
    monkeypatch.setattr(hardware, "native_bf16", lambda accelerator="cpu": native)
    caplog.set_level("WARNING", logger="dalle_lightning")
    strategy_and_precision(_cfg("bf16-mixed"))
    strategy_and_precision(_cfg("32-true"))
    strategy_and_precision(_cfg("auto"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ([] if native else [warnings[0]])
    if not native:
        assert "precision bf16-mixed computes in 16 bits, which this cpu emulates" in warnings[0]
