"""Issue 70: a sharded stage keeps no whole copy of the model (``benchmarks/memory.py`` measures what it saves).

On 2 gloo processes at ``devices_per_node=2``, during the fit (a callback at every training batch): every parameter
of the user's children has given its storage back (0 bytes), the parameters the stage trains hold this rank's shard
only (about half of the model), and the buffers it trains with are the user's own (FSDP2 leaves buffers whole: no
copy). After the fit the user's own tensor objects hold the whole trained values,
``ddp``'s. The same holds for the shapes a user builds: a frozen child, a child with buffers only, a
``"bf16-true"`` fit (the dtype ``ddp`` leaves), and a model built under ``init_module(empty_init=True)`` with a
tensor on the LightningModule itself (no meta tensor left, every rank the same values).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from tests.helpers.distributed import run_distributed
from tests.helpers.stranger_residual import WIDTH, Residual
from tests.test_module_after_stage import stage_loader, stage_trainer
from tests.test_strategy_common import external_launch_env

WORLD = 2


class Shapes(Residual):
    """A frozen child, a child with buffers only, a buffer on the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.stats = nn.BatchNorm1d(WIDTH, affine=False)
        self.register_buffer("offset", torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stats(self.frozen(self.inp(x)))
        return self.gain(self.out(self.blocks(h))) + self.offset


class Watch(Callback):
    """What the user's tensors hold during the stage: their bytes, and this rank's share of the trained ones."""

    def __init__(self, user: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        self.user, self.buffers, self.held, self.trained, self.own_buffers = user, buffers, [], [], []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.held.append(sum(t.untyped_storage().nbytes() for t in self.user))
        self.own_buffers.append(all(any(b is u for u in self.buffers) for b in pl_module.buffers()))
        local = [getattr(p, "to_local", lambda p=p: p)() for p in pl_module.parameters()]
        self.trained.append(sum(t.numel() for t in local) / sum(p.numel() for p in pl_module.parameters()))


def _state(module: nn.Module) -> dict[str, Any]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {"values": {n: t.detach().float().clone() for n, t in tensors},
            "kind": {n: (type(t.data).__name__, str(t.device), t.dtype, t.requires_grad) for n, t in tensors},
            "ids": {n: id(t) for n, t in tensors}}


def _fit(layout: str, rank: int, **kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Shapes()
    user = [p for child in module.children() for p in child.parameters()]
    ids = {n: id(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    watch = Watch(user, list(module.buffers()))
    stage_trainer(layout, callbacks=[watch], **kwargs).fit(module, stage_loader(rank))
    return {**_state(module), "ids_before": ids, "held": watch.held, "trained": watch.trained,
            "own_buffers": watch.own_buffers}


def _empty_init(rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # ranks build apart: the stage must start them alike
    trainer = stage_trainer("dpn2")
    with trainer.init_module(empty_init=True):
        module = Shapes()
    trainer.fit(module, stage_loader(rank))
    return _state(module)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    external_launch_env(rank)
    return {"ddp": _fit("ddp", rank), "dpn2": _fit("dpn2", rank),
            "ddp-bf16": _fit("ddp", rank, precision="bf16-true"), "dpn2-bf16": _fit("dpn2", rank, precision="bf16-true"),
            "empty": _empty_init(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout=300)


pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("case", ["", "-bf16"])
def test_the_stage_holds_shards_only_and_gives_the_users_tensors_back_as_ddp(results: list[dict[str, Any]],
                                                                             case: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[f"dpn2{case}"], rank_out[f"ddp{case}"]
        assert ddp["held"][0] > 0 and set(ours["held"]) == {0}, ours["held"]  # no parameter byte of the user's
        assert all(0.3 < share < 0.7 for share in ours["trained"]), ours["trained"]  # about half: this rank's shards
        assert ours["own_buffers"] == ddp["own_buffers"], ours["own_buffers"]  # the user's (fp32), or ddp's new ones
        # the user's own tensor objects, wherever ddp keeps them (ddp's bf16 conversion makes new buffers, as here)
        kept = {n for n, i in ours["ids_before"].items() if ours["ids"][n] == i}
        assert kept == {n for n, i in ddp["ids_before"].items() if ddp["ids"][n] == i}
        assert kept >= {n for n, _ in Shapes().named_parameters()}
        assert ours["kind"] == ddp["kind"]  # plain, on the CPU, ddp's dtype, requires_grad as built
        for name, value in ddp["values"].items():
            tol = 1e-2 if case else 1e-6
            torch.testing.assert_close(ours["values"][name], value, atol=tol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_model_built_on_the_meta_device_comes_back_materialised_and_alike(results: list[dict[str, Any]]) -> None:
    first, second = (r["empty"] for r in results)
    assert all(kind[1] == "cpu" and kind[0] == "Tensor" for kind in first["kind"].values()), first["kind"]
    for name, value in first["values"].items():
        assert torch.isfinite(value).all(), name
        if not name.startswith("stats."):  # running statistics are each rank's own after its forwards, as under ddp
            assert torch.equal(value, second["values"][name]), name
