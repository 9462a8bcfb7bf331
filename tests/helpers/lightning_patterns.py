"""LightningModules written the ways Lightning users write them, each training under ``ddp``: the patterns a user who
moves a working ``ddp`` model to ``ShardedPowerSGDStrategy`` brings along (``tests/test_module_patterns.py``).

Each is small (a few thousand parameters, widths that split unevenly over 2 ranks) and deterministic given
``torch.manual_seed``; each names its children the way the pattern needs. Torch and Lightning only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn

WIDTH = 12


def _mlp(width: int = WIDTH) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


class Base(L.LightningModule):
    """An input layer, a body of two blocks, a head; SGD with momentum on ``self.parameters()``."""

    lr = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.body = nn.Sequential(_mlp(), _mlp())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.tanh(self.inp(x))))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class GroupsInInit(Base):
    """Parameter groups built in ``__init__`` from the children's parameters, returned by ``configure_optimizers``."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = [{"params": list(self.inp.parameters()) + list(self.body.parameters())},
                       {"params": list(self.head.parameters()), "lr": 0.01}]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.groups, lr=self.lr, momentum=0.9)


class GroupsInConfigure(Base):
    """Parameter groups built in ``configure_optimizers`` (the documented way), each child its own learning rate,
    and a frozen-by-group weight decay on biases."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=0.01)


class GroupsByMark(Base):
    """Parameters marked in ``__init__`` (``p.no_decay = True``, as nanoGPT-style recipes tag them), split into
    weight-decay groups by the mark in ``configure_optimizers``."""

    def __init__(self) -> None:
        super().__init__()
        for name, p in self.named_parameters():
            if name.endswith("bias") or name.startswith("body.1"):
                p.no_decay = True

    def configure_optimizers(self) -> Any:
        marked = [p for p in self.parameters() if getattr(p, "no_decay", False)]
        rest = [p for p in self.parameters() if not getattr(p, "no_decay", False)]
        return torch.optim.AdamW([{"params": rest, "weight_decay": 0.5}, {"params": marked, "weight_decay": 0.0}],
                                 lr=0.01)


class TiedAttribute(Base):
    """The module's own name for a child's parameter, used in ``forward``: ``self.head_w = self.inp.weight``
    registers the same Parameter on the LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.head_w = self.inp.weight  # (WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(torch.tanh(self.inp(x)))
        return self.head(h) + (h @ self.head_w).sum(-1, keepdim=True) * 0.1


class TiedAcrossChildren(Base):
    """Weights tied between two children (an embedding and its unembedding, as GPT-2): one Parameter, two owners."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.body[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(self.body(torch.tanh(self.inp(x)))))


class SharedModule(Base):
    """One child registered under two names (``self.again = self.body[1]``), run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.again = self.body[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(self.body(torch.tanh(self.inp(x)))))


class TapsList(Base):
    """A plain list attribute holding a child (not registered twice), used in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.taps = [self.body[0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(self.body(h) + 0.5 * self.taps[0](h))


class _Counting(nn.Module):
    """A block with state of its own besides tensors: a lock (which no deep copy can take), and the forwards it ran
    and a history list, which a callback or the step changes during the fit as users count things on a module."""

    def __init__(self, lock: bool = True) -> None:
        super().__init__()
        self.net = _mlp()
        self.lock = threading.Lock() if lock else contextlib.nullcontext()
        self.calls = 0
        self.history: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
        return self.net(x)


class ChildState(Base):
    """A child's own non-tensor state (a counter, a list, a lock), changed during the fit: after it the user's child
    holds what the fit did (``seen``), as under ``ddp``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(_Counting(), _Counting())

    def on_train_batch_end(self, *args: Any) -> None:
        self.body[1].history.append(self.global_step)

    @property
    def seen(self) -> list[int]:
        return [self.body[0].calls, self.body[1].calls, len(self.body[1].history)]


class ChildCounter(ChildState):
    """:class:`ChildState` without the lock: a counter and a list only (any copy of the child would take them, and
    drift from the user's without a word)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(_Counting(lock=False), _Counting(lock=False))


class FrozenChild(Base):
    """A frozen child (a pretrained encoder a user does not train) before a trained body."""

    def __init__(self) -> None:
        super().__init__()
        self.inp.requires_grad_(False)


class BuffersOnlyChild(Base):
    """A child holding buffers and no parameters (normalisation constants), used in ``forward``."""

    class Normalize(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.tensor([0.1, -0.2, 0.3, 0.0]))
            self.register_buffer("std", torch.tensor([1.5, 0.5, 2.0, 1.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - self.mean) / self.std

    def __init__(self) -> None:
        super().__init__()
        self.norm = self.Normalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


class NormedRefit(Base):
    """A batch norm after the input layer (running statistics that follow each rank's batches), fitted twice by one
    Trainer, each rank recalibrating the statistics on its own batch between the fits: the second fit's first forward
    takes rank 0's buffers, as a fresh ``DistributedDataParallel`` does, though the first fit's last forward was
    validation's (no grad: no broadcast before the forward after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.tanh(self.norm(self.inp(x)))))


class OwnParameter(Base):
    """A parameter of the LightningModule itself (a learned output scale), not in any child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.7, 1.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.sum()


class ConfigureModel(Base):
    """Children built in ``configure_model`` (Lightning's hook for sharded strategies), nothing in ``__init__``."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if getattr(self, "body", None) is not None:
            return
        torch.manual_seed(0)
        self.inp = nn.Linear(4, WIDTH)
        self.body = nn.Sequential(_mlp(), _mlp())
        self.head = nn.Linear(WIDTH, 1)


class Accumulating(Base):
    """Trained with ``accumulate_grad_batches=2`` (the Trainer's argument; the module is Base's)."""


class Manual(Base):
    """Manual optimization: two optimizers, one step each per batch, ``manual_backward``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        body_opt, head_opt = self.optimizers()  # type: ignore[misc]
        loss = F.mse_loss(self(batch[0]), batch[1])
        body_opt.zero_grad()
        head_opt.zero_grad()
        self.manual_backward(loss)
        body_opt.step()
        head_opt.step()

    def configure_optimizers(self) -> Any:
        body = [*self.inp.parameters(), *self.body.parameters()]
        return torch.optim.SGD(body, lr=self.lr), torch.optim.SGD(self.head.parameters(), lr=0.02)


class LineSearch(Base):
    """LBFGS, whose ``step`` evaluates the closure several times (Lightning passes it the training step's)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


class SparseEmbedding(Base):
    """An ``nn.Embedding(sparse=True)`` in front (a sparse gradient), plain SGD, which takes one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.emb((x[:, 0].abs() * 4).long().clamp(max=7)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ListBody(Base):
    """Blocks in an ``nn.ModuleList`` looped over in ``forward``, as a transformer's layers (nanoGPT's ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList([_mlp(), _mlp()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.body:
            x = block(x)
        return self.head(x)


class WeightPenalty(ListBody):
    """An L2 penalty on a block's weight, read in ``training_step`` outside the block's ``forward``
    (Lightning-Bolts' ``LogisticRegression`` regularises ``self.linear.weight`` so)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-2 * self.body[0][0].weight.pow(2).sum()


class PenaltyList(ListBody):
    """A penalty over parameters captured in a plain list in ``__init__`` (the user's own parameter objects)."""

    def __init__(self) -> None:
        super().__init__()
        self.regularised = [self.body[1][2].weight, self.head.weight]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 0.1 * sum(p.abs().sum() for p in self.regularised)


class TiedFunctional(ListBody):
    """A parent reading a block's weight without calling the block: ``F.linear(x, self.body[1][2].weight)``, as
    a head tied to an embedding by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.body:
            x = block(x)
        return self.head(torch.tanh(F.linear(x, self.body[1][2].weight)))


class ParentReadsChild(Base):
    """``nn.MultiheadAttention``, which hands ``out_proj.weight`` to ``F.multi_head_attention_forward`` without
    calling ``out_proj`` (trained with ``block_classes=[nn.Linear]``, so ``out_proj`` is a unit of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).unsqueeze(1)
        return self.head(self.body(self.attn(h, h, h, need_weights=False)[0].squeeze(1)))


class GradNormLogged(Base):
    """Lightning's documented recipe: ``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class GradientsRead(Base):
    """``on_after_backward`` reads every gradient whole (``.full_tensor()`` where it is a strategy's shard) and
    keeps the norms (``seen``), as a user's gradient monitor does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []

    def on_after_backward(self) -> None:
        whole = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in self.parameters()]
        self.seen.append([float(g.norm()) for g in whole])


class WeightNormLogged(Base):
    """A weight monitor in ``on_train_batch_end``: ``float(self.body[0][0].weight.norm())``, as users log it under
    ``ddp``."""

    def on_train_batch_end(self, *args: Any) -> None:
        self.log("w_norm", float(self.body[0][0].weight.norm()))


class WeightsReadWhole(Base):
    """The same monitor in ``on_train_batch_end`` and a callback-style read in ``on_validation_epoch_end``, each
    through ``.full_tensor()`` where the weight is a strategy's shard; keeps the norms (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []

    def _whole_norms(self) -> list[float]:
        weights = [self.body[0][0].weight, self.body[1][2].weight, self.head.weight]
        return [float((w.full_tensor() if hasattr(w, "full_tensor") else w).norm()) for w in weights]

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(self._whole_norms())

    def on_validation_epoch_end(self) -> None:
        self.seen.append(self._whole_norms())


class _Blocks(nn.Sequential):
    """A user's own container of blocks, with its own ``forward`` (torch 2.9 compiles no frame of torch's own
    modules: ``nn.Sequential(...).compile()`` runs eagerly there, under any strategy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = block(x)
        return x


class _Head(nn.Linear):
    """A user's own output layer (its own ``forward``: compiled on every torch, as :class:`_Blocks`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class CompiledChild(Base):
    """Children compiled with ``nn.Module.compile(backend=..., fullgraph=True)``, each with its own counting backend
    (``compiles[name]``: how many graphs it compiled): the body, whose blocks are FSDP2 units under the strategy,
    and the head, inside none. The same modules and initial values as :class:`Base`."""

    compiles: dict[str, int] = {"body": 0, "head": 0}

    def __init__(self) -> None:
        super().__init__()
        self.body = _Blocks(*self.body)
        head = _Head(WIDTH, 1, device="meta")  # no draw from the seeded generator
        head.load_state_dict(self.head.state_dict(), assign=True)
        self.head = head
        for name in self.compiles:
            getattr(self, name).compile(backend=functools.partial(_counting_backend, name), fullgraph=True)


def _counting_backend(name: str, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    CompiledChild.compiles[name] += 1
    return gm.forward


PATTERNS: dict[str, type[Base]] = {
    "groups_in_init": GroupsInInit,
    "groups_in_configure": GroupsInConfigure,
    "groups_by_mark": GroupsByMark,
    "tied_attribute": TiedAttribute,
    "tied_across_children": TiedAcrossChildren,
    "shared_module": SharedModule,
    "taps_list": TapsList,
    "child_state": ChildState,
    "child_counter": ChildCounter,
    "frozen_child": FrozenChild,
    "buffers_only_child": BuffersOnlyChild,
    "own_parameter": OwnParameter,
    "configure_model": ConfigureModel,
    "accumulating": Accumulating,
    "manual": Manual,
    "line_search": LineSearch,
    "sparse_embedding": SparseEmbedding,
    "undeclared_list": ListBody,
    "undeclared_whole": Base,
    "compiled_child": CompiledChild,
    "weight_penalty": WeightPenalty,
    "penalty_list": PenaltyList,
    "tied_functional": TiedFunctional,
    "parent_reads_child": ParentReadsChild,
    "own_parameter_clipped": OwnParameter,
    "grad_norm_logged": GradNormLogged,
    "gradients_read": GradientsRead,
    "weight_norm_logged": WeightNormLogged,
    "weights_read_whole": WeightsReadWhole,
    "normed_refit": NormedRefit,
}

# Fitted twice by one Trainer (the second fit takes ``REFIT_STEPS`` more steps).
REFIT = ("normed_refit",)
REFIT_STEPS = 1  # odd: the second fit ends on a training step (validation every 2 would broadcast again)

# Trainer arguments a pattern needs besides the defaults.
TRAINER_ARGS: dict[str, dict[str, Any]] = {"accumulating": {"accumulate_grad_batches": 2},
                                           "own_parameter_clipped": {"gradient_clip_val": 0.05}}
