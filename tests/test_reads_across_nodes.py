"""Code that reads a unit's weight outside the unit's ``forward`` trains as under ``ddp`` across nodes too.

4 gloo processes. The model's residual branches are FSDP2 units; its ``forward`` reads two branch weights without
calling the branch (``F.linear(x, self.backbone[1].fc1.weight)``, as a head tied by hand) and ``training_step``
adds an L2 penalty on a third. The strategy runs at 2 nodes x 2 devices, PowerSGD at full rank, with
``overlap="auto"`` and ``overlap=True`` (the read weights' gradients reach their shards while the overlapped
exchange runs), and at one node of 4. Every parameter within 1e-4 of ``ddp``'s on every rank, and every rank equal
bit for bit where ``ddp``'s are.
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


class ReadsOutside(L.LightningModule):
    """An embedding, two residual branches (the units, by default: an ``nn.ModuleList``), a head; weights of the
    branches read in ``forward`` and in ``training_step`` outside the branches' own ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.backbone = nn.ModuleList(Branch(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.backbone:
            x = x + block(x)
        wide = torch.tanh(F.linear(x, self.backbone[1].fc1.weight))  # (.., 2 * WIDTH)
        return self.head(x + 0.5 * F.linear(wide, self.backbone[0].fc2.weight))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self, *batch) + 1e-2 * self.backbone[0].fc1.weight.pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _runs(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    out = {}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        module = ReadsOutside()
        trainer(layout_strategy(layout, WORLD), devices=WORLD, max_epochs=EPOCHS,
                limit_train_batches=BATCHES).fit(module, loader(token_dataset(), rank, world_size=WORLD))
        out[layout] = {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_weights_read_outside_their_unit_train_as_ddp_across_nodes() -> None:
    results = run_distributed(_runs, WORLD, timeout=400)
    reference = [r["ddp"] for r in results]
    torch.manual_seed(0)
    initial = dict(ReadsOutside().named_parameters())
    moved = max(float((reference[0][k] - initial[k].detach()).abs().max()) for k in reference[0])
    assert moved > 1e-3, "the reference trained nothing"
    problems = []
    for layout in LAYOUTS[1:]:
        mine = [r[layout] for r in results]
        worst = max(float((m[k] - ref[k]).abs().max()) for m, ref in zip(mine, reference) for k in ref)
        if worst > 1e-4:
            problems.append(f"{layout}: {worst:.3g} from ddp's weights")
        for key in reference[0]:
            if all(torch.equal(r[key], reference[0][key]) for r in reference):
                spread = max(float((m[key] - mine[0][key]).abs().max()) for m in mine)
                if spread:
                    problems.append(f"{layout}: {key} differs between ranks by {spread:.3g} (ddp's ranks agree)")
    assert not problems, problems
