"""A backbone unfrozen mid-fit trains as under ``ddp``: averaged over every rank, and given back unfrozen.

4 gloo processes. The backbone (two residual branches between an embedding and a head, each branch an FSDP2 unit)
is frozen when the strategy sets up, and unfrozen part-way through the fit, two ways:

- by hand: ``self.backbone.requires_grad_(True)`` at a given step, its parameters in the optimizer from the start;
- by Lightning's ``BackboneFinetuning``: frozen in the callback's ``setup``, unfrozen at an epoch's start into a
  new parameter group of its own learning rate.

The reference is ``ddp``, whose reducer takes the parameters that require a gradient when it wraps the module (no
``find_unused_parameters`` or ``static_graph`` setting changes that): a parameter unfrozen later is not averaged
by ``ddp``, and its ranks drift apart. So the reference averages the unfrozen gradients by hand
(``AverageUnfrozen``, an ``on_after_backward`` all-reduce), as a ``ddp`` user has to.

The strategy runs at 2 nodes x 2 devices with PowerSGD at full rank (the average up to a QR's arithmetic), with
``overlap="auto"`` (its first updates overlapped, then alternating) and ``overlap=True``: every parameter within
1e-4 of ``ddp``'s on every rank, every rank equal bit for bit (as ``ddp``'s are), and the user's own parameters
(the same objects as before the fit) with ``requires_grad=True`` after it; the latter on one node of 4 too.
The two parts of the fix, in one process: the overlapped exchange buckets a parameter unfrozen since it attached,
and the ``requires_grad`` of FSDP2's parameter goes back to the user's parameter with its values.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from dalle_lightning_plugins.compression.exchange import OverlappedExchange
from dalle_lightning_plugins.strategies import in_place
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import (VOCAB, WIDTH, Branch, external_launch_env, layout_strategy, loader, loss_fn,
                                        token_dataset, trainer)

WORLD, BATCHES, EPOCHS, UNFREEZE_STEP = 4, 3, 2, 2
RUNS = {  # name -> (layout, how the backbone is unfrozen)
    "ddp hand": ("ddp", "hand"), "ddp callback": ("ddp", "callback"),
    "2x2 auto hand": ("auto", "hand"), "2x2 auto callback": ("auto", "callback"),
    "2x2 overlap hand": ("overlap", "hand"), "2x2 overlap callback": ("overlap", "callback"),
    "1x4 callback": ("one node", "callback"),
}


class Finetuned(L.LightningModule):
    """An embedding, a two-branch residual backbone and a head; ``hand``: the backbone frozen from the start and
    unfrozen by hand at step ``UNFREEZE_STEP``, in the optimizer throughout. Else ``BackboneFinetuning`` does it
    (the optimizer then takes the parameters requiring a gradient, as the callback asks)."""

    def __init__(self, hand: bool) -> None:
        super().__init__()
        self.hand = hand
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.backbone = nn.ModuleList(Branch(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)
        if hand:
            self.backbone.requires_grad_(False)

    def resblocks(self) -> list[nn.Module]:
        return list(self.backbone)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.backbone:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self, *batch)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.hand and self.global_step == UNFREEZE_STEP:
            self.backbone.requires_grad_(True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if self.hand or p.requires_grad], lr=0.5)


class AverageUnfrozen(L.Callback):
    """``ddp``'s missing average: the backbone's gradients, which its reducer does not know, over every rank."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for p in pl_module.backbone.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def _fit(rank: int, layout: str, how: str) -> dict:
    torch.manual_seed(0)
    module = Finetuned(hand=how == "hand")
    own = {n: p for n, p in module.named_parameters()}
    callbacks: list[L.Callback] = [AverageUnfrozen()] if layout == "ddp" else []
    if how == "callback":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, initial_denom_lr=1.0))
    trainer(layout_strategy(layout, WORLD), devices=WORLD, max_epochs=EPOCHS, limit_train_batches=BATCHES,
            callbacks=callbacks).fit(module, loader(token_dataset(), rank, world_size=WORLD))
    after = dict(module.named_parameters())
    return {"weights": {n: p.detach().float().cpu().clone() for n, p in after.items()},
            "same objects": all(after[n] is p for n, p in own.items()) and set(after) == set(own),
            "frozen after": sorted(n for n, p in own.items() if not p.requires_grad)}


def _runs(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    return {name: _fit(rank, *run) for name, run in RUNS.items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_backbone_unfrozen_mid_fit_is_averaged_over_every_rank_and_given_back_unfrozen() -> None:
    results = run_distributed(_runs, WORLD, timeout=400)
    problems = []
    for name, (layout, how) in RUNS.items():
        if layout == "ddp":
            continue
        reference = [r[f"ddp {how}"]["weights"] for r in results]
        mine = [r[name]["weights"] for r in results]
        worst = max(float((m[k] - ref[k]).abs().max()) for m, ref in zip(mine, reference) for k in ref)
        if worst > 1e-4:
            problems.append(f"{name}: {worst:.3g} from ddp's weights")
        for key in reference[0]:
            if all(torch.equal(r[key], reference[0][key]) for r in reference):  # ddp's ranks agree: bit for bit
                spread = max(float((m[key] - mine[0][key]).abs().max()) for m in mine)
                if spread:
                    problems.append(f"{name}: {key} differs between ranks by {spread:.3g} (ddp's ranks agree)")
        for rank, r in enumerate(results):
            if r[name]["frozen after"] or not r[name]["same objects"]:
                problems.append(f"{name}: rank {rank}: the user's parameters frozen after the fit: "
                                f"{r[name]['frozen after'][:3]}, the same objects: {r[name]['same objects']}")
    # the reference itself: the backbone trained after its unfreezing, and ddp's ranks agree everywhere
    torch.manual_seed(0)
    start = dict(Finetuned(hand=True).named_parameters())
    for how in ("hand", "callback"):
        ref = [r[f"ddp {how}"]["weights"] for r in results]
        assert all(torch.equal(r[k], ref[0][k]) for r in ref for k in ref[0]), how
        assert all(not torch.equal(ref[0][k], p.detach()) for k, p in start.items() if k.startswith("backbone")), how
    assert not problems, "\n".join(problems)


def test_the_overlapped_exchange_buckets_a_parameter_unfrozen_since_it_attached() -> None:
    module = Finetuned(hand=True)
    exchange = OverlappedExchange(None, None, None)  # type: ignore[arg-type]  # no collective before a bucket is sent
    exchange.attach(module, ["backbone.0", "backbone.1"], set(), set())
    bucketed = lambda: {n for b in exchange.buckets for n, _ in b.params}  # noqa: E731
    assert bucketed() == {"embed.weight", "head.weight", "head.bias"}
    attached = dict(module.named_parameters())
    module.backbone[1].requires_grad_(True)
    module.head.weight = nn.Parameter(module.head.weight.detach().clone())  # as FSDP2's gathered root in a backward
    exchange.begin(active=False)  # a backward that does not overlap: its buckets are not used
    exchange.begin(active=True)
    assert bucketed() == {"embed.weight", "head.weight", "head.bias", *(f"backbone.1.{n}" for n, _ in
                                                                        module.backbone[1].named_parameters())}
    assert all(p is attached[n] for b in exchange.buckets for n, p in b.params)  # the parameters that train
    assert [b.name for b in exchange.buckets][0] == "backbone.1"  # in backward order, before the root's
    module.embed.requires_grad_(False)
    exchange.begin(active=True)
    assert "embed.weight" not in bucketed()
    exchange.detach()
    assert not exchange.buckets


def test_a_parameter_unfrozen_in_the_stage_gives_the_users_parameter_back_unfrozen() -> None:
    module = Finetuned(hand=True)
    own = module.backbone[0].fc1.weight
    kept = in_place.InPlace(in_place.children_with_tensors(module))
    for k in kept.kept.values():  # what fully_shard does: its own parameter objects in the user's modules' place
        for m, name in k.owners:
            m._parameters[name] = nn.Parameter(torch.zeros_like(k.tensor), requires_grad=k.tensor.requires_grad)
    kept.release(list(kept.kept))
    module.backbone.requires_grad_(True)  # BackboneFinetuning during the stage: on FSDP2's parameters
    module.head.requires_grad_(False)
    kept.to_plain(torch.device("cpu"))
    assert module.backbone[0].fc1.weight is own and own.requires_grad and not torch.count_nonzero(own)
    assert all(p.requires_grad for p in module.backbone.parameters())
    assert not any(p.requires_grad for p in module.head.parameters())
    kept = in_place.InPlace(in_place.children_with_tensors(module))  # after an error, each rank alone: the same
    for k in kept.kept.values():
        for m, name in k.owners:
            m._parameters[name] = nn.Parameter(k.tensor.detach().clone(), requires_grad=k.tensor.requires_grad)
    module.embed.requires_grad_(False)
    assert not kept.restore_locally(torch.device("cpu")) and not module.embed.weight.requires_grad
