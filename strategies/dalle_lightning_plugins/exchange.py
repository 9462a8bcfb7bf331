"""The inter-node gradient exchange, overlapped with the backward: buckets, staging, asynchronous collectives.

Between nodes the link is slow (the reason the paper compresses with PowerSGD), so waiting for the whole backward
before sending anything leaves the link idle while the device computes, then the device idle while the link
sends. Here every *bucket* of gradients (one resblock's parameters; the root's parameters last) starts its
exchange as soon as its last gradient is accumulated, as DDP's communication hooks do per bucket, and the step
waits only for what is still in flight once the backward ends.

Each bucket is two all-reduces over the replicate group, with PowerSGD's arithmetic in between::

    M = e + g (staged, e untouched)   ->  all-reduce [dense gradients, P^T = Q^T M^T]   (the "P" group)
    P <- orthonormal basis of P       ->  all-reduce Q'^T = P^T M                       (the "Q" group)

Collectives on one process group must be issued in the same order on every rank (gloo matches them by a
sequence tag given at issue time). The P all-reduces are issued in bucket order; a Q all-reduce can start only
once its P has arrived, which happens at a different moment on every rank, so the Q's travel on a process group
of their own, again in bucket order. Mixing both on one group is what makes torch's own PowerSGD hook fail on
gloo ("Received data size doesn't match expected size").

The paper's semantics are kept exactly:

* nothing is committed during the backward: each bucket's ``M``, factors and averages are staged, and only
  after the one flag all-reduce of the step (non-finite gradients anywhere, unused parameters, embedding rows)
  are they written into the gradients and error buffers, or dropped, leaving every error buffer untouched
  when the update is skipped;
* ``Q`` is PowerSGD's fixed Gaussian (or last step's ``Q'`` with ``warm_start``); embeddings, vectors and what
  would not shrink go uncompressed in fp32;
* an embedding's gradient is sent only in the rows some rank used (every other row is exactly zero on every
  rank): each rank's used rows ride in the flag all-reduce (MAX), and the union is averaged;
* the step has one host synchronisation: reading the agreed flags.

Where the overlap cannot apply (manual optimisation, a non-final micro-batch, a loss-scaling precision that
unscales in the step, several devices per node) the strategy calls :meth:`PowerSGD.reduce` at the end of the
backward instead, as before; a bucket that never becomes ready in the backward (a parameter this rank gave no
gradient) is sent at the end, after the flags, with zeros for the gradients it lacks, as ``ddp`` does with
``find_unused_parameters``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.comm_dtype import from_comm, to_comm
from dalle_lightning_plugins.householder import orthogonalize_all
from dalle_lightning_plugins.powersgd import FP32_BYTES, PowerSGD, finite_per_tensor

ROOT_BUCKET = "<root>"  # parameters outside every resblock: sent after the flags (embedding rows need them)
MASK_BYTES = 1  # one uint8 per embedding row in the flag all-reduce


class ExchangeError(RuntimeError):
    """A collective of the exchange failed (a peer or the link is down); ``waiting_on`` names it."""

    def __init__(self, waiting_on: str, error: BaseException) -> None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"{waiting_on}: {first}")
        self.waiting_on, self.reason = waiting_on, first


@dataclass
class Bucket:
    """A group of parameters exchanged together: one resblock's, or the root's (``ROOT_BUCKET``)."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    ready: int = 0  # gradients accumulated in this backward
    bytes: int = 0  # of its parameters


@dataclass
class _Flight:
    """One bucket's exchange in progress: what it sends, the staged values, and its collectives."""

    bucket: str
    dense: list[tuple[str, torch.Tensor, torch.Tensor | None]]  # (name, grad, rows sent, None for all)
    low: list[tuple[str, torch.Tensor, int]]  # (name, grad, rank)
    mats: list[torch.Tensor] = field(default_factory=list)  # staged M = e + g, fp32
    n_dense: int = 0  # dense elements at the front of p_buf (fp32 wire), else in dense_buf
    dense_buf: torch.Tensor | None = None  # fp32 dense gradients, apart from a 16-bit P wire
    p_buf: torch.Tensor | None = None
    works: list[dist.Work] = field(default_factory=list)  # dense and P all-reduces
    dense_mean: torch.Tensor | None = None
    ps: list[torch.Tensor] = field(default_factory=list)  # orthonormal P of every matrix
    q_buf: torch.Tensor | None = None
    q_work: dist.Work | None = None
    q_issued: bool = False
    sent: int = 0  # bytes this rank contributes


class OverlappedExchange:
    """Averages a model's gradients between nodes during its backward; see the module docstring.

    Args:
        powersgd: the compressor whose settings and state (Q, error buffers, counters) this exchange uses; the
            same object serves the end-of-backward path, so a run can switch between both at any step.
        p_group, q_group: two process groups over the same replicate ranks (see the module docstring).
        flag_group: the group over which the skip decision and unused gradients are agreed (every rank).
        bucket_cap_mb: consecutive resblocks share a bucket while their parameters fit in this many MiB (0: one
            bucket per resblock). Each bucket costs two collectives, and each collective a wake-up of the
            communication threads, which on busy cores costs more than the bytes on a fast link (the demo's prior
            at 50 Mbit/s: 3.53-3.64 updates/s at 1 MiB, 3.05-3.43 at one bucket per resblock; docs/results.md).
    """

    def __init__(self, powersgd: PowerSGD, p_group: dist.ProcessGroup, q_group: dist.ProcessGroup,
                 flag_group: dist.ProcessGroup | None = None, bucket_cap_mb: float = 1.0) -> None:
        self.powersgd = powersgd
        self.bucket_cap_mb = bucket_cap_mb
        self.p_group, self.q_group, self.flag_group = p_group, q_group, flag_group
        self.buckets: list[Bucket] = []
        self._uncompressed: set[str] = set()
        self._row_sparse: list[str] = []  # names of the embedding tables sent by used rows
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._active = False
        self._flights: list[_Flight] = []  # issued this step, in bucket order
        self._unscale: Callable[[list[torch.Tensor]], None] | None = None
        self.waiting_on = ""  # the collective the step is waiting for, for an error that names it

    # ------------------------------------------------------------------ set-up

    def attach(self, module: nn.Module, block_names: Sequence[str], uncompressed: set[str],
               row_sparse: set[str]) -> None:
        """Bucket ``module``'s trainable parameters by resblock (in backward order, last block first; the root's
        parameters last) and hook every one: the backward then issues each bucket once it is complete."""
        self.detach()
        self._uncompressed = set(uncompressed)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        taken: set[int] = set()
        blocks: list[Bucket] = []
        for block in block_names:
            prefix = block + "."
            members = [(n, p) for n, p in named if n.startswith(prefix) and id(p) not in taken]
            taken.update(id(p) for _, p in members)
            if members:
                blocks.append(Bucket(block, members))
        rest = [(n, p) for n, p in named if id(p) not in taken]
        merged: list[Bucket] = []
        for block in blocks[::-1]:  # backward order; consecutive blocks share a bucket up to bucket_cap_mb
            size = sum(p.numel() * p.element_size() for _, p in block.params)
            if merged and merged[-1].bytes + size <= self.bucket_cap_mb * 2**20:
                merged[-1].params += block.params
                merged[-1].name += "+" + block.name
                merged[-1].bytes += size
            else:
                block.bytes = size
                merged.append(block)
        self.buckets = merged + ([Bucket(ROOT_BUCKET, rest)] if rest else [])
        self._row_sparse = [n for n, p in rest if n in row_sparse and p.dim() == 2]
        for index, bucket in enumerate(self.buckets[:-1] if rest else self.buckets):
            for _, p in bucket.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.buckets = []

    def _hook(self, index: int):
        def ready(_: torch.Tensor) -> None:
            if self._active:
                bucket = self.buckets[index]
                bucket.ready += 1
                try:
                    self._issue_ready()
                except (RuntimeError, dist.DistError) as error:
                    raise ExchangeError(self.waiting_on or f"the exchange of bucket {bucket.name}", error) from error
        return ready

    # ------------------------------------------------------------------ one step

    def begin(self, active: bool, unscale: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Before a backward: ``active`` when this backward ends the step and may overlap (else the hooks idle).
        ``unscale``: a loss-scaling precision's ``unscale_group``, applied to each group before it is sent."""
        if self._flights:
            raise RuntimeError("OverlappedExchange.begin() with an exchange still in flight; finish() it first")
        self._active = active and bool(self.buckets)
        self._unscale = unscale
        self.waiting_on = ""
        for bucket in self.buckets:
            bucket.ready = 0

    @property
    def active(self) -> bool:
        return self._active

    def _issue_ready(self) -> None:
        """Issue, in bucket order, every bucket whose gradients are all there; then start the Q's whose P is in."""
        last = len(self.buckets) - (self.buckets[-1].name == ROOT_BUCKET)
        while len(self._flights) < last:
            bucket = self.buckets[len(self._flights)]
            if bucket.ready < len(bucket.params):
                break
            self._issue(bucket, rows={})
        self._progress(block=False)

    def finish(self) -> bool:
        """After the backward: agree on the flags, send what is left, wait, commit. False: skip the update."""
        try:
            return self._finish()
        except ExchangeError:
            raise
        except (RuntimeError, dist.DistError) as error:
            raise ExchangeError(self.waiting_on or "the end of the exchange", error) from error

    @torch.no_grad()
    def _finish(self) -> bool:
        assert self._active
        self._active = False
        ps = self.powersgd
        named = [(n, p) for bucket in self.buckets for n, p in bucket.params]
        grads = [p.grad for _, p in named if p.grad is not None]
        bad = (~finite_per_tensor(grads).all()).reshape(1) if grads else torch.zeros(1, dtype=torch.bool)
        masks = [self._used_rows(p) for n, p in named if n in self._row_sparse]
        used = torch.tensor([p.grad is not None for _, p in named], dtype=torch.uint8)
        flags = torch.cat([used.to(bad.device), bad.to(torch.uint8), *[m.to(bad.device) for m in masks]])
        if dist.is_initialized():
            self.waiting_on = "the flag all-reduce (non-finite gradients, unused parameters, embedding rows)"
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.flag_group)
        flags_host = flags.cpu()  # the step's one host synchronisation
        n = len(named)
        anywhere_used = flags_host[:n].bool().tolist()
        finite = not bool(flags_host[n])
        rows: dict[str, torch.Tensor] = {}
        offset = n + 1
        for name, mask in zip(self._row_sparse, masks):
            rows[name] = flags_host[offset: offset + mask.numel()].nonzero().flatten()
            offset += mask.numel()
        # Gradients another rank has: zeros here (ddp's find_unused_parameters); one nobody used stays None.
        for (name, p), was_used in zip(named, anywhere_used):
            if was_used and p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self.buckets[len(self._flights):]:
            if finite or bucket.name != ROOT_BUCKET:  # a skipped step still matches the others' collectives
                self._issue(bucket, rows, skip_unused=True)
        self._progress(block=True)
        flights, self._flights = self._flights, []
        if not finite:
            ps.stats.record_skip()
            return False
        sent = MASK_BYTES * sum(m.numel() for m in masks) if ps.replicas > 1 else 0
        for flight in flights:
            self._commit(flight)
            sent += flight.sent
        ps.stats.steps += 1
        ps.stats._record(sent, sum(p.numel() for _, p in named if p.grad is not None) * FP32_BYTES)
        ps._step += 1
        return True

    @staticmethod
    def _used_rows(p: nn.Parameter) -> torch.Tensor:
        """1 for each row of an embedding gradient holding a non-zero (or non-finite) value, else 0."""
        if p.grad is None:
            return torch.zeros(p.shape[0], dtype=torch.uint8, device=p.device)
        return p.grad.ne(0).any(dim=1).to(torch.uint8)

    # ------------------------------------------------------------------ a bucket's two collectives

    def _issue(self, bucket: Bucket, rows: dict[str, torch.Tensor], skip_unused: bool = False) -> None:
        """Stage a bucket's M and P and issue its P all-reduce (with its dense gradients on an fp32 wire)."""
        ps = self.powersgd
        if self._unscale is not None:  # per-block scales are fixed within a step: unscale as it is sent
            self._unscale([p for _, p in bucket.params if p.grad is not None])
        plain = ps._step < ps.start_step
        dense: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        low: list[tuple[str, torch.Tensor, int]] = []
        for name, p in bucket.params:
            if p.grad is None:
                if skip_unused:
                    continue  # no rank used it: left alone, as under ddp
                raise RuntimeError(f"bucket {bucket.name} issued without a gradient for {name}")
            g = p.grad
            r = 0 if plain or name in self._uncompressed else ps.plan(g.shape)
            if r:
                low.append((name, g, r))
            else:
                dense.append((name, g, rows.get(name)))
        flight = _Flight(bucket.name, dense, low)
        dense_parts = [(g if idx is None else g.index_select(0, idx.to(g.device))).reshape(-1).float()
                       for _, g, idx in dense]
        pts = []
        for name, g, r in low:
            g2 = g.reshape(g.shape[0], -1)
            m = ps.error_buffer(name, g2.shape, g.device).add(g2) if ps.error_feedback else g2.float()
            flight.mats.append(m)
            pts.append((ps.fixed_q(name, m.shape[1], r, g.device).T @ m.T).reshape(-1))
        n_dense = sum(t.numel() for t in dense_parts)
        n_p = sum(t.numel() for t in pts)
        flight.sent = n_dense * FP32_BYTES + n_p * self._wire_bytes
        if ps.comm_dtype == torch.float32 or not low:
            flight.n_dense = n_dense
            flight.p_buf = torch.cat(dense_parts + pts) if dense_parts or pts else torch.zeros(0)
        else:
            flight.dense_buf = torch.cat(dense_parts) if dense_parts else None
            flight.p_buf = self._wire(torch.cat(pts))
        for buf in (flight.dense_buf, flight.p_buf):
            if buf is not None and buf.numel():
                flight.works.append(dist.all_reduce(buf, group=self.p_group, async_op=True))
        self._flights.append(flight)

    @property
    def _wire_bytes(self) -> int:
        return torch.finfo(self.powersgd.comm_dtype).bits // 8

    def _wire(self, flat: torch.Tensor) -> torch.Tensor:
        """A 16-bit wire: divided by the replicas first and clamped, so the sum cannot overflow the format."""
        world = self.powersgd.replicas
        return to_comm(flat / world, self.powersgd.comm_dtype, summands=world)

    def _progress(self, block: bool) -> None:
        """Start the Q all-reduce of every issued bucket whose P has arrived, in bucket order (all when ``block``)."""
        for flight in self._flights:
            if flight.q_issued:
                continue
            if not block and not all(w.is_completed() for w in flight.works):
                return
            self.waiting_on = f"the P all-reduce of bucket {flight.bucket}"
            for w in flight.works:
                w.wait()
            self._issue_q(flight)
        if block:
            for flight in self._flights:
                if flight.q_work is not None:
                    self.waiting_on = f"the Q' all-reduce of bucket {flight.bucket}"
                    flight.q_work.wait()

    def _issue_q(self, flight: _Flight) -> None:
        """P has arrived: orthogonalise it, stage Q'^T = P^T M and issue its all-reduce on the Q group."""
        ps = self.powersgd
        world = ps.replicas
        flight.q_issued = True
        assert flight.p_buf is not None
        if flight.dense_buf is None:
            mean = flight.p_buf.div_(world)
            flight.dense_mean, pts_flat = mean[:flight.n_dense], mean[flight.n_dense:]
        else:
            flight.dense_mean = flight.dense_buf.div_(world)
            pts_flat = from_comm(flight.p_buf)
        if not flight.low:
            return
        sizes = [r * m.shape[0] for (_, _, r), m in zip(flight.low, flight.mats)]
        pts = [c.view(r, m.shape[0]) for c, (_, _, r), m in zip(pts_flat.split(sizes), flight.low, flight.mats)]
        flight.ps = orthogonalize_all([pt.T for pt in pts], ps.eps)
        qts = torch.cat([(p.T @ m).reshape(-1) for p, m in zip(flight.ps, flight.mats)])
        flight.q_buf = qts if ps.comm_dtype == torch.float32 else self._wire(qts)
        flight.sent += qts.numel() * self._wire_bytes
        flight.q_work = dist.all_reduce(flight.q_buf, group=self.q_group, async_op=True)

    @torch.no_grad()
    def _commit(self, flight: _Flight) -> None:
        """Write one bucket's averages into its gradients and its new error buffers (finite steps only)."""
        ps = self.powersgd
        offset = 0
        mean = flight.dense_mean
        for _, g, idx in flight.dense:
            assert mean is not None
            if idx is None:
                g.copy_(mean[offset: offset + g.numel()].view(g.shape))
                offset += g.numel()
            else:
                size = idx.numel() * g[0].numel()
                chunk = mean[offset: offset + size].view(idx.numel(), *g.shape[1:])
                g.index_copy_(0, idx.to(g.device), chunk.to(g.dtype))  # every other row is zero on every rank
                offset += size
        if not flight.low:
            return
        assert flight.q_buf is not None
        qflat = flight.q_buf.div_(ps.replicas) if ps.comm_dtype == torch.float32 else from_comm(flight.q_buf)
        sizes = [r * m.shape[1] for (_, _, r), m in zip(flight.low, flight.mats)]
        for (name, g, r), m, p, qt in zip(flight.low, flight.mats, flight.ps, qflat.split(sizes)):
            qt = qt.view(r, m.shape[1])
            if g.is_contiguous() and g.dtype == torch.float32:
                approx = torch.mm(p, qt, out=g.view(m.shape))  # straight into the gradient
            else:
                approx = p @ qt
                g.copy_(approx.view(g.shape))
            if ps.error_feedback:
                m.sub_(approx)
                # The paper's rule, without a host sync: a contaminated buffer starts again from zero.
                m.masked_fill_(~finite_per_tensor([m])[0], 0.0)
                ps.set_error_buffer(name, m)
            if ps.warm_start:
                ps.set_q(name, qt.T.clone())
