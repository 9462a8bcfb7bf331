"""Module patterns train as under ``ddp`` across nodes too: 4 gloo processes, the strategy at 2 nodes x 2 devices
with PowerSGD at full rank, ``overlap="auto"`` and ``overlap=True``, and at one node of 4.

An embedding, two residual branches (the units, by default: an ``nn.ModuleList``) and a head, four ways:

* ``reads``: ``forward`` reads two branch weights without calling the branch (``F.linear(x,
  self.backbone[1].fc1.weight)``, as a head tied by hand) and ``training_step`` adds an L2 penalty on a third (the
  read weights' gradients reach their shards while the overlapped exchange runs);
* ``clipped``: ``gradient_clip_val`` (the norm over every rank's shards, after the average between nodes);
* ``tied``: the head's weight is the embedding's (GPT-2's tie: one parameter, two owners);
* ``batchnorm``: a ``BatchNorm1d`` in each branch (running statistics broadcast from rank 0 before each forward,
  as ``ddp``'s ``broadcast_buffers``).

Every parameter and buffer within 1e-4 of ``ddp``'s on every rank, and every rank equal bit for bit where
``ddp``'s are. (LBFGS is refused at setup, ``tests/test_optimizer_closure.py``; manual optimization with two steps
per backward is ``tests/test_manual_steps_across_nodes.py``, a backbone unfrozen mid-fit
``tests/test_unfrozen_mid_fit.py``.)
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import (VOCAB, WIDTH, Branch, external_launch_env, layout_strategy, loader, loss_fn,
                                        token_dataset, trainer)

WORLD, BATCHES, EPOCHS = 4, 3, 2
LAYOUTS = ("ddp", "auto", "overlap", "one node")
KINDS = ("reads", "clipped", "tied", "batchnorm")


class Net(L.LightningModule):
    """An embedding, two residual branches, a head; ``kind`` picks the pattern (see the module)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.backbone = nn.ModuleList(Branch(WIDTH) for _ in range(2))
        self.norms = nn.ModuleList(nn.BatchNorm1d(WIDTH) for _ in range(2)) if kind == "batchnorm" else None
        self.head = nn.Linear(WIDTH, VOCAB)
        if kind == "tied":
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.backbone):
            x = x + block(x)
            if self.norms is not None:
                x = self.norms[i](x.transpose(1, 2)).transpose(1, 2)
        if self.kind == "reads":
            wide = torch.tanh(F.linear(x, self.backbone[1].fc1.weight))  # (.., 2 * WIDTH)
            x = x + 0.5 * F.linear(wide, self.backbone[0].fc2.weight)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self, *batch)
        if self.kind == "reads":
            loss = loss + 1e-2 * self.backbone[0].fc1.weight.pow(2).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _runs(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    out = {}
    for kind in KINDS:
        for layout in LAYOUTS:
            torch.manual_seed(0)
            module = Net(kind)
            trainer(layout_strategy(layout, WORLD), devices=WORLD, max_epochs=EPOCHS, limit_train_batches=BATCHES,
                    gradient_clip_val=0.05 if kind == "clipped" else None,
                    ).fit(module, loader(token_dataset(), rank, world_size=WORLD))
            tensors = [*module.named_parameters(), *module.named_buffers()]
            out[(kind, layout)] = {n: t.detach().float().cpu().clone() for n, t in tensors}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_runs, WORLD, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_pattern_trains_as_ddp_across_nodes(results: list[dict], kind: str) -> None:
    reference = [r[(kind, "ddp")] for r in results]
    torch.manual_seed(0)
    net = Net(kind)
    initial = {n: t.detach().float() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    assert max(float((reference[0][k] - initial[k]).abs().max()) for k in initial) > 1e-3, "ddp trained nothing"
    problems = []
    for layout in LAYOUTS[1:]:
        mine = [r[(kind, layout)] for r in results]
        assert sorted(mine[0]) == sorted(reference[0]), layout
        worst = max(float((m[k] - ref[k]).abs().max()) for m, ref in zip(mine, reference) for k in ref)
        if worst > 1e-4:
            problems.append(f"{layout}: {worst:.3g} from ddp's")
        for key in reference[0]:
            if all(torch.equal(r[key], reference[0][key]) for r in reference):
                spread = max(float((m[key] - mine[0][key]).abs().max()) for m in mine)
                if spread:
                    problems.append(f"{layout}: {key} differs between ranks by {spread:.3g} (ddp's ranks agree)")
    assert not problems, problems
