"""Behaviours of Lightning a user's LightningModule may rely on, each runnable under ``ddp`` or the sharded strategy.

A case is ``case(layout, rank, workdir) -> dict[str, Tensor]``: it builds a small LightningModule from a fixed
seed, trains it on 2 CPU processes under ``layout`` and returns what must match ``ddp`` (the final weights of the
whole model on this rank, plus whatever else the behaviour produces, e.g. predictions or a logged value).
Layouts: ``"ddp"`` (Lightning's ``DDPStrategy``, the reference), ``"dpn2"`` (``ShardedPowerSGDStrategy`` with
``devices_per_node=2``: 1 node of 2, FSDP2 only) and ``"dpn1"`` (``devices_per_node=1``: 2 nodes of 1, PowerSGD
at full rank, which is exact averaging up to the arithmetic of the QR).

:func:`run_cases` is the worker ``tests/helpers/distributed.run_distributed`` starts; it runs many cases per
process launch (start-up costs seconds) under a per-case time limit, leaving a marker file per case so the
caller can tell which case failed or hung, and how.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_callbacks.ema import EMA
from dalle_lightning_callbacks.nonfinite import NonFiniteGuard
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.test_strategy_common import VOCAB, WIDTH, TinyResNet, token_dataset

WORLD = 2
LAYOUTS = ("ddp", "dpn2", "dpn1")
CASE_LIMIT = 90.0  # seconds per case and layout; a hang past it kills the launch and names the case
DATA = token_dataset(n=48)


# ---------------------------------------------------------------------------------------------------- parts
def strategy(layout: str, *, find_unused: bool = False, checkpoint_format: str = "full") -> Any:
    """The layout's strategy; ``find_unused`` is for ddp, ``checkpoint_format`` for the sharded strategy."""
    if layout == "ddp":
        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=find_unused)
    fmt = {} if checkpoint_format == "full" else {"checkpoint_format": checkpoint_format}  # the default unsaid
    if layout == "dpn2":
        return ShardedPowerSGDStrategy(devices_per_node=2, timeout=CASE_LIMIT, **fmt)
    if layout == "dpn1":  # full PowerSGD rank: every matrix here has a side of at most 2 * WIDTH
        return ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=4 * WIDTH, min_compression=0.0,
                                       timeout=CASE_LIMIT, **fmt)
    raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")


def make_trainer(layout: str, workdir: Path | None = None, strategy_: Any = None, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, max_steps=3,
        default_root_dir=str(workdir) if workdir else None,
    )
    return L.Trainer(strategy=strategy_ if strategy_ is not None else strategy(layout), **{**defaults, **kwargs})


def loader(rank: int, batch: int = 2, data: TensorDataset = DATA) -> DataLoader:
    """Rank ``rank`` reads items rank, rank + 2, ... in order, under every layout."""
    return DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, WORLD, rank, shuffle=False))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def full_weights(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Collective under FSDP2: every parameter and buffer whole, on this rank, as fp32 on the CPU."""
    out = {}
    for name, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.is_floating_point():
            out[prefix + name] = value.detach().float().cpu().clone()
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


class Plain(L.LightningModule):
    """TinyResNet trained with SGD + momentum; validation, test and predict steps; ``self.model`` is the net."""

    def __init__(self, lr: float = 0.1, net: Callable[[], nn.Module] = TinyResNet) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.model = net()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", loss_of(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", loss_of(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def fit(layout: str, module: L.LightningModule, rank: int, workdir: Path | None = None, val: bool = False,
        ckpt_path: Path | str | None = None, **kwargs: Any) -> L.Trainer:
    trainer = make_trainer(layout, workdir, **kwargs)
    trainer.fit(module, loader(rank), loader(rank) if val else None, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------------------------------------------- cases
def case_fit_validate_test_predict(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    trainer = fit(layout, module, rank, val=True, max_steps=-1, max_epochs=1, limit_train_batches=3,
                  limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    val = trainer.validate(module, loader(rank), verbose=False)[0]["val_loss"]
    test = trainer.test(module, loader(rank), verbose=False)[0]["test_loss"]
    preds = torch.cat(trainer.predict(module, loader(rank)))
    return {**full_weights(module), "val": torch.tensor(val), "test": torch.tensor(test), "pred": preds.float()}


def case_grad_accumulation(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, accumulate_grad_batches=2)
    return full_weights(module)


def case_clip_norm(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    return full_weights(module)


def case_clip_value(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, gradient_clip_val=0.005, gradient_clip_algorithm="value")
    return full_weights(module)


class Scheduled(Plain):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def case_scheduler(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Scheduled()
    fit(layout, module, rank)
    return full_weights(module)


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss_of(self(batch[0]), batch[1]))
        opt.step()


def case_manual_optimization(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Manual()
    fit(layout, module, rank)
    return full_weights(module)


class ManualSecondForward(Manual):
    """A second forward after ``manual_backward`` (a metric on the updated model, as GAN and RL code does)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.log("after_step", loss_of(self(batch[0]), batch[1]))


def case_manual_second_forward(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = ManualSecondForward()
    fit(layout, module, rank)
    return full_weights(module)


class ManualRootOnly(Manual):
    """A second update in the same step through parameters outside the blocks only (embedding and head)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss_of(self.model.head(self.model.embed(batch[0])), batch[1]))
        opt.step()


def case_manual_second_update_outside_blocks(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = ManualRootOnly()
    fit(layout, module, rank, strategy_=strategy(layout, find_unused=True))
    return full_weights(module)


class TwoOptimizers(Plain):
    """GAN-style: the blocks and the rest have their own optimizer, stepped one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(loss_of(self(batch[0]), batch[1]))
            opt.step()

    def configure_optimizers(self) -> Any:
        blocks = list(self.model.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [torch.optim.SGD(blocks, lr=0.1), torch.optim.SGD(rest, lr=0.05)]


def case_two_optimizers(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = TwoOptimizers()
    fit(layout, module, rank)
    return full_weights(module)


def _checkpointed_run(layout: str, rank: int, workdir: Path, resume: str, fmt: str = "full") -> dict[str, torch.Tensor]:
    kwargs: dict[str, Any] = dict(max_steps=-1, limit_train_batches=2, limit_val_batches=2, enable_checkpointing=True)
    ckpt = ModelCheckpoint(dirpath=workdir / "ckpt", monitor="val_loss", save_top_k=2, save_last=True)
    module = Plain()
    fit(layout, module, rank, val=True, max_epochs=3, callbacks=[ckpt], strategy_=strategy(layout, checkpoint_format=fmt),
        **kwargs)
    kept = torch.tensor(float(len(ckpt.best_k_models)))
    on_disk = torch.tensor(float(len(list((workdir / "ckpt").iterdir()))))
    best = ckpt.best_model_path if resume == "best" else ckpt.last_model_path
    module = Plain()
    fit(layout, module, rank, val=True, max_epochs=4, ckpt_path=best, strategy_=strategy(layout, checkpoint_format=fmt),
        callbacks=[ModelCheckpoint(dirpath=workdir / "ckpt2")], **kwargs)
    return {**full_weights(module), "kept": kept, "on_disk": on_disk}


def case_checkpoint_topk_resume_last(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    return _checkpointed_run(layout, rank, workdir, "last")


def case_checkpoint_resume_best(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    return _checkpointed_run(layout, rank, workdir, "best")


def case_checkpoint_topk_resume_last_sharded_format(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """The same with ``checkpoint_format="sharded"`` (DCP directories) under the strategy."""
    return _checkpointed_run(layout, rank, workdir, "last", fmt="sharded")


class Gathering(Plain):
    """``sync_dist`` logging and ``all_gather``: both reach the result, so a wrong one shows in the weights."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self(batch[0]), batch[1])
        gathered = self.all_gather(batch[0].float().mean())  # (world,) on every rank
        self.gathered = gathered.detach().cpu()
        self.log("synced", batch[0].float().mean() * (self.global_rank + 1), sync_dist=True)
        return loss * (1 + gathered[1] / 100)


def case_sync_dist_all_gather(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Gathering()
    trainer = fit(layout, module, rank)
    return {**full_weights(module), "gathered": module.gathered.float(),
            "synced": trainer.callback_metrics["synced"].float().cpu()}


def case_early_stopping(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain(lr=0.5)
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=0.05)
    trainer = fit(layout, module, rank, val=True, max_steps=-1, max_epochs=6, limit_train_batches=2,
                  limit_val_batches=2, callbacks=[stop])
    return {**full_weights(module), "epochs": torch.tensor(float(trainer.current_epoch))}


def case_frozen_parameters(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    module.model.embed.requires_grad_(False)
    module.model.blocks[1].fc1.requires_grad_(False)
    fit(layout, module, rank)
    return full_weights(module)


class Tied(TinyResNet):
    """Unembedding tied to the embedding (one Parameter in two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight


def case_tied_parameters(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain(net=Tied)
    fit(layout, module, rank)
    return full_weights(module)


def case_compiled_block(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    module.model.blocks[1].compile(backend="eager")
    fit(layout, module, rank)
    return full_weights(module)


class Deferred(Plain):
    """The model is built in ``configure_model`` (Lightning's hook for large models), not in ``__init__``."""

    def __init__(self) -> None:
        super().__init__(net=lambda: None)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyResNet()


def case_configure_model(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Deferred()
    fit(layout, module, rank)
    return full_weights(module)


def case_precision_bf16_mixed(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, precision="bf16-mixed")
    return full_weights(module)


def case_precision_bf16_true(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, precision="bf16-true")
    return full_weights(module)


class Overflowing(Plain):
    """fp16 autocast with Lightning's GradScaler; the loss of step 1 is huge, so its gradients overflow."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self(batch[0]), batch[1])
        return loss * 1e30 if batch_idx == 1 else loss


def case_precision_16_mixed_gradscaler(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Overflowing()
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    fit(layout, module, rank, plugins=[plugin], max_steps=4)
    return {**full_weights(module), "scale": torch.tensor(float(plugin.scaler.get_scale()))}


def case_fit_twice(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    trainer = make_trainer(layout, max_steps=-1, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, loader(rank), loader(rank))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, loader(rank), loader(rank))
    return full_weights(module)


def case_new_trainer_same_model(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain()
    fit(layout, module, rank, max_steps=2)
    fit(layout, module, rank, max_steps=2)
    return full_weights(module)


class SharedBlock(TinyResNet):
    """ALBERT-style sharing: one block object applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[2] = self.blocks[0]


def case_shared_block(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain(net=SharedBlock)
    fit(layout, module, rank)
    return full_weights(module)


def case_init_module_empty(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """Initialised without memory (meta tensors under the strategy), then loaded from a plain state dict."""
    reference = Plain().state_dict()
    trainer = make_trainer(layout)
    with trainer.init_module(empty_init=True):
        module = Plain()
    module.load_state_dict(reference, assign=True)
    trainer.fit(module, loader(rank))
    return full_weights(module)


def case_init_module_empty_materialised(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """Initialised without memory and never loaded: the strategy materialises the parameters (``reset_parameters``);
    ``ddp`` leaves them as uninitialised memory, so only finiteness and agreement between ranks are compared."""
    trainer = make_trainer(layout)
    with trainer.init_module(empty_init=True):
        module = Plain()
    if layout == "ddp":  # DDP's empty init is uninitialised memory: give it numbers so the run is defined
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.1)
    trainer.fit(module, loader(rank))
    return full_weights(module)


class UnusedOnSomeRanks(Plain):
    """An auxiliary head only rank 0 uses, and a layer nobody uses (``ddp(find_unused_parameters=True)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(WIDTH, VOCAB)
        self.never = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self(batch[0]), batch[1])
        if self.global_rank == 0:
            loss = loss + loss_of(self.aux(self.model.embed(batch[0])), batch[1])
        return loss


def case_unused_on_some_ranks(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = UnusedOnSomeRanks()
    fit(layout, module, rank, strategy_=strategy(layout, find_unused=True))
    return full_weights(module)


class BlockSkippedOnSomeRanks(Plain):
    """Rank 1 skips the middle block (layer drop decided per rank): a whole FSDP unit unused there."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        net = self.model
        x = net.embed(batch[0])
        for i, block in enumerate(net.blocks):
            if not (i == 1 and self.global_rank == 1):
                x = x + block(x)
        return loss_of(net.head(x), batch[1])


def case_block_skipped_on_some_ranks(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = BlockSkippedOnSomeRanks()
    fit(layout, module, rank, strategy_=strategy(layout, find_unused=True))
    return full_weights(module)


def case_save_load_checkpoint(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """``trainer.save_checkpoint`` writes what ``load_from_checkpoint`` reads; ``fit(ckpt_path=)`` takes a ddp file."""
    ddp_file = workdir / "from_ddp.ckpt"
    module = Plain()
    fit("ddp", module, rank, max_steps=2).save_checkpoint(ddp_file)
    module = Plain()
    trainer = fit(layout, module, rank, max_steps=4, ckpt_path=ddp_file)
    path = workdir / "saved.ckpt"
    trainer.save_checkpoint(path)
    trained = full_weights(module)
    loaded = Plain.load_from_checkpoint(path, map_location="cpu")
    return {**trained, **full_weights(loaded, "loaded.")}


class Normed(TinyResNet):
    """TinyResNet with a batch norm before the head: running statistics in buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


def case_batchnorm_buffers(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = Plain(net=Normed)
    fit(layout, module, rank)
    return full_weights(module)


def case_batchnorm_validation(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """ddp broadcasts rank 0's buffers before the forward after a synchronised grad-enabled one: the first
    validation forward of each epoch (the sanity check's first, with a fresh wrapper), so a fit that ends with a
    validation leaves every rank rank 0's running statistics."""
    module = Plain(net=Normed)
    fit(layout, module, rank, val=True, max_steps=-1, max_epochs=2, limit_train_batches=3, limit_val_batches=2,
        num_sanity_val_steps=1)
    return full_weights(module)


def case_batchnorm_accumulation(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """With accumulation ddp broadcasts before the first micro-batch of each window, not the synchronised last."""
    module = Plain(net=Normed)
    fit(layout, module, rank, max_steps=3, accumulate_grad_batches=2)
    return full_weights(module)


def case_batchnorm_weight_averaging(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    """Lightning's ``EMAWeightAveraging`` (buffers averaged too) swaps its copy in for each validation: ddp's
    broadcast before the first validation forward reaches the averaged buffers; with accumulation as well."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    module = Plain(net=Normed)
    averaging = EMAWeightAveraging(decay=0.5)
    fit(layout, module, rank, val=True, max_steps=-1, max_epochs=2, limit_train_batches=4, limit_val_batches=2,
        accumulate_grad_batches=2, callbacks=[averaging])
    return {**full_weights(module), **full_weights(averaging._average_model.module, "averaged.")}  # noqa: SLF001


class GradientsSeen(Plain):
    """Records a gradient as ``on_after_backward`` and ``on_before_optimizer_step`` see it (first step)."""

    def on_after_backward(self) -> None:
        if self.global_step == 0:
            self.after_backward = whole(self.model.head.weight.grad)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_step == 0:
            self.before_step = whole(self.model.head.weight.grad)


def case_hook_gradients(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = GradientsSeen()
    fit(layout, module, rank, max_steps=1)
    return {"on_before_optimizer_step": module.before_step, "on_after_backward": module.after_backward}


class LogitScale(Plain):
    """A 0-d parameter (CLIP's logit scale); batch 1's loss is NaN on rank 1, so that update must be skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self(batch[0]) * self.scale, batch[1])
        return loss * float("nan") if batch_idx == 1 and self.global_rank == 1 else loss


def case_nonfinite_scalar_parameter(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    module = LogitScale()
    guard = NonFiniteGuard(max_skipped_share=1.0)
    trainer = fit(layout, module, rank, max_steps=3, callbacks=[guard])
    return {**full_weights(module), "skipped": torch.tensor(float(guard.counts(trainer)[0]))}


def case_ema_frozen_resume(layout: str, rank: int, workdir: Path, fmt: str = "full") -> dict[str, torch.Tensor]:
    def frozen() -> Plain:
        module = Plain()
        module.model.embed.requires_grad_(False)
        return module

    path = workdir / "ema.ckpt"
    fit(layout, frozen(), rank, max_steps=2, callbacks=[EMA(decay=0.5)], strategy_=strategy(layout, checkpoint_format=fmt)
        ).save_checkpoint(path)
    module = frozen()
    fit(layout, module, rank, max_steps=4, ckpt_path=path, callbacks=[EMA(decay=0.5)],
        strategy_=strategy(layout, checkpoint_format=fmt))
    return full_weights(module)


def case_ema_frozen_resume_sharded_format(layout: str, rank: int, workdir: Path) -> dict[str, torch.Tensor]:
    return case_ema_frozen_resume(layout, rank, workdir, fmt="sharded")


CASES: dict[str, Callable[[str, int, Path], dict[str, torch.Tensor]]] = {
    name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")
}
# What ddp cannot be compared with (its empty init is uninitialised memory): checked only for agreement and finiteness.
NO_DDP_REFERENCE = {"init_module_empty_materialised"}


# ---------------------------------------------------------------------------------------------------- the worker
def marker(workdir: Path, name: str, layout: str, rank: int) -> Path:
    return workdir / "markers" / f"{name}.{layout}.{rank}"


def run_cases(rank: int, world_size: int, plan: list[tuple[str, str]], workdir: str) -> None:
    """Run ``plan`` = [(case, layout), ...] in order; for each, write ``<case>.<layout>.<rank>`` under
    ``workdir/markers``: the case's tensors when it passed, else the first line of its failure (or of the hang).

    The first failure ends the launch (a failed collective leaves the process group unusable); the caller
    starts a new launch for the rest. A case running past ``CASE_LIMIT`` seconds ends the process.
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    root = Path(workdir)
    (root / "markers").mkdir(parents=True, exist_ok=True)
    for name, layout in plan:
        out = marker(root, name, layout, rank)
        case_dir = root / name / layout
        case_dir.mkdir(parents=True, exist_ok=True)
        watchdog = threading.Timer(CASE_LIMIT, _hung, (out,))
        watchdog.daemon = True
        watchdog.start()
        try:
            torch.manual_seed(0)
            result: Any = CASES[name](layout, rank, case_dir)
        except BaseException as err:
            watchdog.cancel()
            torch.save(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}", out)
            traceback.print_exc()
            raise
        watchdog.cancel()
        torch.save(result, out)
        dist.barrier()


def _hung(out: Path) -> None:
    torch.save(f"hang: no progress within {CASE_LIMIT:.0f} s", out)
    os._exit(3)
