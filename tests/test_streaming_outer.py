"""Streaming DiLoCo in ``LocalStepsStrategy``: fragments synced in turn, syncs that overlap inner updates, the
int8 and bf16 wires of the outer step.

- the int8 wire: each element within half its block's step, a non-finite element spoils only its block;
- every wire's average over 2 real processes against the exact mean (fp32 bit-exact);
- a 2-node run with 2 fragments, a delay of 1 and ``local_mix`` 0.5 against the same algorithm written out in one
  process (two model copies, the schedule by hand), with the global copy equal on both nodes after every update;
- a checkpoint saved while a sync is on the wire changes nothing, and a resume from it is exact (int8 wire).
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from dalle_lightning_plugins.strategies.local_steps import LocalStepsStrategy
from dalle_lightning_plugins.compression.outer_step import split_fragments
from dalle_lightning_plugins.compression.outer_wire import INT8_BLOCK, dequantize_int8, quantize_int8, start_average
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, loss_fn, token_dataset, trainer


def test_int8_wire_rounds_each_element_within_half_a_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(3 * INT8_BLOCK + 17) * torch.logspace(-3, 2, 3 * INT8_BLOCK + 17)
    payload = quantize_int8(x)
    assert payload.dtype == torch.int8 and payload.numel() == 4 * INT8_BLOCK + 4 * 4  # 4 blocks, 4 scales
    back = dequantize_int8(payload, x.numel())
    step = torch.cat([x[i:i + INT8_BLOCK].abs().max().expand(len(x[i:i + INT8_BLOCK])) / 127
                      for i in range(0, len(x), INT8_BLOCK)])
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())
    x[5] = float("inf")
    back = dequantize_int8(quantize_int8(x), x.numel())
    assert bool(back[:INT8_BLOCK].isnan().all()) and bool(back[INT8_BLOCK:].isfinite().all())


def _averages(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)
    x = torch.randn(2500) * (rank + 1)
    return {str(d): start_average(x.clone(), d, None, world_size).wait()
            for d in (torch.float32, torch.bfloat16, torch.int8)} | {"own": x}


@pytest.mark.distributed
def test_every_wire_averages_over_the_replicas() -> None:
    a, b = run_distributed(_averages, 2, timeout=120)
    exact = (a["own"] + b["own"]) / 2
    assert torch.equal(a["torch.float32"], exact) and torch.equal(b["torch.float32"], exact)
    scale = a["own"].abs() + b["own"].abs()
    bounds = {"torch.bfloat16": scale * 2 ** -8,  # each half rounded (2^-9 of it), then the sum (2^-9 of it)
              "torch.int8": (a["own"].abs().max() + b["own"].abs().max()).expand_as(scale) / 508}  # half a step each
    for wire, bound in bounds.items():
        assert torch.equal(a[wire], b[wire]), wire  # every rank the same mean
        err = (a[wire] - exact).abs()
        assert bool((err <= bound * (1 + 1e-5)).all()) and err.max() > 0, (wire, float((err / bound).max()))


H, FRAGMENTS, MIX, INNER_LR, OUTER_LR, OUTER_MOMENTUM, STEPS = 2, 2, 0.5, 0.3, 0.7, 0.5, 5
STREAMING = dict(sync_every=H, fragments=FRAGMENTS, local_mix=MIX, outer_comm_dtype="float32", outer_lr=OUTER_LR,
                 outer_momentum=OUTER_MOMENTUM)


def streaming_reference(keep: bool, delay: int) -> dict[str, torch.Tensor]:
    """The algorithm in one process: 2 nodes' models (node r reads items r, r + 2, ..., 2 per batch), inner SGD,
    fragment k (``split_fragments``) leaving at updates k + 1, k + 1 + H, ..., its mean pseudo-gradient applied by
    Nesterov SGD ``delay`` updates later, each node's weights half its own and half the new global weights plus its
    update since the send (``keep``: ``keep_overlapped``, else the new global weights alone); at the end the pending sync lands, the
    fragments that moved since their last send are averaged unmixed, and both nodes take the global weights."""
    torch.manual_seed(0)
    first = TinyResNet()
    nodes = [TinyResNet(), TinyResNet()]
    for node in nodes:
        node.load_state_dict(first.state_dict())
    inner = [torch.optim.SGD(n.parameters(), lr=INNER_LR) for n in nodes]
    glob = [p.detach().clone() for p in first.parameters()]
    outer = torch.optim.SGD(glob, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    parts = split_fragments([p.numel() for p in glob], FRAGMENTS)
    tokens, targets = token_dataset().tensors

    def pseudo(k: int) -> list[torch.Tensor]:
        return [glob[i] - sum(list(n.parameters())[i].detach() for n in nodes) / 2 for i in parts[k]]

    def own(k: int) -> list[list[torch.Tensor]]:
        return [[glob[i] - list(n.parameters())[i].detach() for i in parts[k]] for n in nodes]

    def land(k: int, mean: list[torch.Tensor], mix: float, owns: list[list[torch.Tensor]] | None) -> None:
        old = [glob[i].clone() for i in parts[k]]
        for i, g in zip(parts[k], mean):
            glob[i].grad = g
        outer.step()
        for j, i in enumerate(parts[k]):
            glob[i].grad = None
            for r, n in enumerate(nodes):
                p = list(n.parameters())[i]
                # the target: the new global weights plus what the node did since the send (local - local_at_send)
                target = glob[i] + (p.data - (old[j] - owns[r][j])) if owns else glob[i]
                p.data = mix * p.data + (1 - mix) * target

    pending: list[tuple[int, int, list[torch.Tensor], list]] = []  # (update it lands at, fragment, mean, owns)
    last_send = [0, 0]
    for u in range(1, STEPS + 1):
        for r, (n, opt) in enumerate(zip(nodes, inner)):
            idx = torch.tensor([r + 4 * (u - 1), r + 4 * (u - 1) + 2])
            opt.zero_grad()
            loss_fn(n, tokens[idx], targets[idx]).backward()
            opt.step()
        for due, k, mean, owns in [p for p in pending if p[0] == u]:
            land(k, mean, MIX, owns)
        pending = [p for p in pending if p[0] != u]
        for k in range(FRAGMENTS):
            if u >= k + 1 and (u - (k + 1)) % H == 0:
                pending.append((u + delay, k, pseudo(k), own(k) if keep else None))
                last_send[k] = u
    for _, k, mean, owns in pending:
        land(k, mean, MIX, owns)
    for k in range(FRAGMENTS):
        if last_send[k] < STEPS:
            land(k, pseudo(k), 0.0, None)
    for i, g in enumerate(glob):
        for n in nodes:
            list(n.parameters())[i].data = g.clone()
    return {f"model.{k}": v.detach() for k, v in nodes[0].state_dict().items()}


class GlobalAgreement(L.Callback):
    """After every update: do both nodes hold the same global copy, and how far apart are their own weights."""

    def __init__(self) -> None:
        self.global_equal: list[bool] = []
        self.divergence: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        flat = torch.cat([g.reshape(-1) for g in trainer.strategy.outer.global_weights])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        self.global_equal.append(torch.equal(*both))
        self.divergence.append(trainer.strategy.replica_divergence())


def _streaming(rank: int, world_size: int, keep: bool, delay: int) -> dict:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=INNER_LR))
    strategy = LocalStepsStrategy(devices_per_node=1, keep_overlapped=keep, sync_delay=delay, **STREAMING)
    agreement = GlobalAgreement()
    trainer(strategy, devices=2, max_steps=STEPS, callbacks=[agreement]).fit(
        module, loader(token_dataset(), rank, world_size=2))
    return {"weights": strategy.full_state_dict(), "global_equal": agreement.global_equal,
            "divergence": agreement.divergence, "end": strategy.replica_divergence(),
            "figures": strategy.exchange_figures()}


@pytest.mark.distributed
@pytest.mark.parametrize(("keep", "delay"), [(True, 1), (False, 1), (True, H)])  # H: lands as the next one leaves
def test_streamed_delayed_mixed_syncs_follow_the_algorithm_written_out(keep: bool, delay: int) -> None:
    res = run_distributed(_streaming, 2, keep, delay, timeout=180)[0]
    for name, want in streaming_reference(keep, delay).items():
        torch.testing.assert_close(res["weights"][name], want, atol=1e-6, rtol=0, msg=name)
    assert res["global_equal"] == [True] * STEPS
    assert all(d > 0 for d in res["divergence"]), res["divergence"]  # mixed, never all equal between syncs
    assert res["end"] == 0.0
    # 5 updates: sends at 1, 2, 3, 4, 5 and the last fragment again at the end: 4 landed in the loop + 2 at the end
    assert res["figures"]["local_steps/syncs"] == 6


EPOCH_OF_3 = token_dataset(n=2 * 2 * 3)  # 2 ranks x batch 2 x 3 updates: the checkpoint at update 3 ends an epoch


def _fit(rank: int, seed: int, ckpt_dir: Path | None = None, ckpt_path: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.AdamW, lr=0.05))
    # fragment 0 leaves at update 2 and lands at 4: on the wire when the checkpoint after update 3 is written
    strategy = LocalStepsStrategy(devices_per_node=1, sync_every=4, fragments=2, sync_delay=2, local_mix=0.5,
                                  outer_comm_dtype="int8")
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)] if ckpt_dir else []
    trainer(strategy, devices=2, max_steps=7, callbacks=callbacks, enable_checkpointing=bool(ckpt_dir)).fit(
        module, loader(EPOCH_OF_3, rank, world_size=2), ckpt_path=ckpt_path)
    return strategy.full_state_dict()


def _resume(rank: int, world_size: int, ckpt_dir: str) -> dict:
    external_launch_env(rank)
    saving = _fit(rank, seed=0, ckpt_dir=Path(ckpt_dir))
    plain = _fit(rank, seed=0)
    mid = next(p for p in sorted(Path(ckpt_dir).iterdir()) if "step=3" in p.name)
    resumed = _fit(rank, seed=123, ckpt_path=str(mid))
    return {"saving": saving, "plain": plain, "resumed": resumed}


@pytest.mark.distributed
def test_a_checkpoint_with_a_sync_on_the_wire_changes_nothing_and_resumes_exactly(tmp_path: Path) -> None:
    res = run_distributed(_resume, 2, str(tmp_path), timeout=240)[0]
    for name, want in res["plain"].items():
        assert torch.equal(res["saving"][name], want), f"{name}: saving a checkpoint changed the run"
        assert torch.equal(res["resumed"][name], want), f"{name}: the resumed run differs"
