"""The inter-node gradient exchange, overlapped with the backward: buckets, staging, asynchronous collectives.

Between nodes the link is slow (the reason the paper compresses with PowerSGD), so waiting for the whole backward
before sending anything leaves the link idle while the device computes, then the device idle while the link
sends. Here every *bucket* of gradients (resblocks' parameters; the root's, then the embeddings, last) starts its
exchange as soon as its last gradient is accumulated, as DDP's communication hooks do per bucket, and the step
waits only for what is still in flight once the backward ends.

Each bucket is two all-reduces over the replicate group, with PowerSGD's stages (:class:`PowerSGD`'s ``form``,
``p_factor``, ``q_factors``, ``commit``; the same ones its end-of-backward path runs) in between::

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

At several devices per node every resblock is an FSDP2 unit, and its bucket is ready once FSDP2 has
reduce-scattered the unit within the node: FSDP2 then calls the sharded parameters' post-accumulate-grad hooks,
the same hooks autograd calls at one device per node. Each rank exchanges its own shard with the ranks holding
the same shard on the other nodes; embedding row flags travel in the whole table's row numbers.

On CUDA the buckets' arithmetic and the waits on their collectives run on a stream of their own, so the backward's
kernels on the default stream do not queue behind them; the step's commit waits for that stream.

Where the overlap cannot apply (manual optimisation, a non-final micro-batch, a loss-scaling precision that
unscales in the step, a unit that ran on no rank or more than once) the strategy calls :meth:`PowerSGD.reduce`
at the end of the backward instead (:func:`~dalle_lightning_plugins.compression.inter_node.exchange_path` decides); a
bucket that never becomes ready in the backward (a parameter this rank gave no gradient) is sent at the end,
after the flags, with zeros for the gradients it lacks, as ``ddp`` does with ``find_unused_parameters``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.strategies.mesh import local_shard
from dalle_lightning_plugins.environments.peer_loss import PeerLost, lost_peer
from dalle_lightning_plugins.compression.powersgd import FP32_BYTES, LowRank, PowerSGD
from dalle_lightning_plugins.compression.step_flags import RowSparse, agree_step_flags, finite_per_tensor

ROOT_BUCKET = "<root>"  # parameters outside every resblock but the embeddings: issued after the last resblock's
ROWS_BUCKET = "<embedding rows>"  # embeddings sent by used rows: after the flags, which carry the rows


class ExchangeError(PeerLost):
    """A collective of the exchange failed because a peer or the link is down (``peer_loss.lost_peer``; any other
    error, a bug, passes through unwrapped); ``waiting_on`` names it."""

    def __init__(self, waiting_on: str, error: BaseException) -> None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"{waiting_on}: {first}")
        self.waiting_on, self.reason = waiting_on, first


@dataclass
class Bucket:
    """A group of parameters exchanged together: one or more resblocks', the root's (``ROOT_BUCKET``) or the
    embeddings sent by rows (``ROWS_BUCKET``)."""

    name: str
    params: list[tuple[str, nn.Parameter]]
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is final in this backward
    bytes: int = 0  # of its parameters


@dataclass
class _Flight:
    """One bucket's exchange in progress: what it sends, the staged values, and its collectives."""

    bucket: str
    dense: list[tuple[str, torch.Tensor, torch.Tensor | None]]  # (name, grad, rows sent, None for all)
    low: list[LowRank]  # the compressed gradients, M staged
    n_dense: int = 0  # dense elements at the front of p_buf (fp32 wire), else in dense_buf
    dense_buf: torch.Tensor | None = None  # fp32 dense gradients, apart from a 16-bit P wire
    p_buf: torch.Tensor | None = None
    works: list[dist.Work] = field(default_factory=list)  # dense and P all-reduces
    dense_mean: torch.Tensor | None = None
    q_buf: torch.Tensor | None = None
    q_work: dist.Work | None = None
    q_issued: bool = False
    sent: int = 0  # bytes this rank contributes


class OverlappedExchange:
    """Averages a model's gradients between nodes during its backward; see the module docstring.

    Args:
        powersgd: the compressor whose settings and state (Q, error buffers, counters) this exchange uses; the
            same object serves the end-of-backward path, so a run can switch between both at any step.
        p_group, q_group: two process groups over this rank's replicate group: the ranks holding the same shard
            on every node (see the module docstring).
        flag_group: the group over which the skip decision and unused gradients are agreed (every rank).
        bucket_cap_mb: consecutive resblocks share a bucket while their parameters fit in this many MiB (0: one
            bucket per resblock). Each bucket costs two collectives, and each collective a wake-up of the
            communication threads, which on busy cores can cost more than the bytes on a fast link
            (docs/results.md, "the strategy over a slow link", has the figures behind the default).
    """

    def __init__(self, powersgd: PowerSGD, p_group: dist.ProcessGroup, q_group: dist.ProcessGroup,
                 flag_group: dist.ProcessGroup | None = None, bucket_cap_mb: float = 1.0) -> None:
        self.powersgd = powersgd
        self.bucket_cap_mb = bucket_cap_mb
        self.p_group, self.q_group, self.flag_group = p_group, q_group, flag_group
        self.buckets: list[Bucket] = []
        self._uncompressed: set[str] = set()
        self._row_sparse: dict[str, tuple[int, int, int]] = {}  # table sent by used rows -> (offset, held, rows)
        self._replicated: list[nn.Parameter] = []  # whole on every rank of a sharded node: averaged over every rank
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._attached, self._trainable = None, []  # attach()'s arguments, each parameter's requires_grad then
        self._active = False
        self._flights: list[_Flight] = []  # issued this step, in bucket order
        self._unscale: Callable[[list[torch.Tensor]], None] | None = None
        self._stream: torch.cuda.Stream | None = None  # on CUDA: the exchange's arithmetic and collectives
        self.waiting_on = ""  # the collective the step is waiting for, for an error that names it

    # ------------------------------------------------------------------ set-up

    def attach(self, module: nn.Module, block_names: Sequence[str], uncompressed: set[str],
               row_sparse: set[str], replicated: Sequence[nn.Parameter] = ()) -> None:
        """Bucket ``module``'s trainable parameters by resblock (in backward order, last block first), then the
        root's other parameters (heads, final norm), then the embeddings sent by rows, and hook all but those
        embeddings: the backward then issues each bucket once it is complete. The embeddings go after the flag
        all-reduce, which carries the rows some rank used; everything else is in flight by then, so the step's
        tail is the flags and one all-reduce of rows (the root's factors were in it before, two more round trips).

        Sharded parameters (FSDP2 units at several devices per node) are hooked the same way: FSDP2 calls their
        post-accumulate-grad hooks once it has reduce-scattered the unit's gradients within the node, so each
        bucket leaves for the other nodes as soon as its unit is averaged over its own. ``replicated``: the
        parameters FSDP2 left whole, averaged over every rank at the end instead. Of the parameters found here (in a
        backward FSDP2 holds the root unit's gathered ones instead), one frozen or unfrozen later
        (``BackboneFinetuning``) is bucketed anew by the next :meth:`begin` of an overlapped backward."""
        self._bucket(list(module.named_parameters()), block_names, uncompressed, row_sparse, replicated)

    def _bucket(self, every: list[tuple[str, nn.Parameter]], block_names: Sequence[str], uncompressed: set[str],
                row_sparse: set[str], replicated: Sequence[nn.Parameter]) -> None:  # attach() on what it found
        self.detach()
        self._attached = (every, block_names, uncompressed, row_sparse, replicated)
        self._trainable = [(p, p.requires_grad) for _, p in every]
        self._uncompressed = set(uncompressed)
        self._replicated = [p for p in replicated if p.requires_grad]
        whole = {id(p) for p in self._replicated}
        named = [(n, p) for n, p in every if p.requires_grad and id(p) not in whole]
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
            size = sum(local_shard(p).numel() * p.element_size() for _, p in block.params)
            if merged and merged[-1].bytes + size <= self.bucket_cap_mb * 2**20:
                merged[-1].params += block.params
                merged[-1].name += "+" + block.name
                merged[-1].bytes += size
            else:
                block.bytes = size
                merged.append(block)
        self._row_sparse = {n: _row_span(p) for n, p in rest if n in row_sparse and p.dim() == 2}
        root = [(n, p) for n, p in rest if n not in self._row_sparse]
        rows = [(n, p) for n, p in rest if n in self._row_sparse]
        self.buckets = merged + ([Bucket(ROOT_BUCKET, root)] if root else []) + ([Bucket(ROWS_BUCKET, rows)] if rows else [])
        device = next((local_shard(p).device for _, p in named), torch.device("cpu"))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for index, bucket in enumerate(self.buckets):
            if bucket.name == ROWS_BUCKET:
                continue
            for _, p in bucket.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.buckets, self._attached, self._trainable = [], None, []

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """On CUDA, the exchange's arithmetic and the waits on its collectives run on a stream of their own, after
        what the backward has queued so far: the backward's later kernels do not queue behind them. On the CPU
        there are no streams."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield

    def _hook(self, index: int):
        def ready(param: torch.Tensor) -> None:
            if self._active:
                bucket = self.buckets[index]
                if id(param) in bucket.ready and index < len(self._flights):
                    raise RuntimeError(f"a gradient of bucket {bucket.name} changed after the bucket was sent (a "
                                       "block reduced twice in one backward); use overlap=False for this model")
                bucket.ready.add(id(param))
                try:
                    with self._side_stream():
                        self._issue_ready()
                except (RuntimeError, dist.DistError) as error:
                    if not lost_peer(error):
                        raise  # a bug keeps its own type and traceback
                    raise ExchangeError(self.waiting_on or f"the exchange of bucket {bucket.name}", error) from error
        return ready

    # ------------------------------------------------------------------ one step

    def begin(self, active: bool, unscale: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Before a backward: ``active`` when this backward ends the step and may overlap (else the hooks idle).
        ``unscale``: a loss-scaling precision's ``unscale_group``, applied to each group before it is sent."""
        if self._flights:
            raise RuntimeError("OverlappedExchange.begin() with an exchange still in flight; finish() it first")
        if active and self._attached and any(p.requires_grad != was for p, was in self._trainable):
            self._bucket(*self._attached)  # the same on every rank: ddp too needs every rank to (un)freeze alike
        self._active = active and bool(self.buckets)
        self._unscale = unscale
        self.waiting_on = ""
        for bucket in self.buckets:
            bucket.ready = set()

    @property
    def active(self) -> bool:
        return self._active

    def _issue_ready(self) -> None:
        """Issue, in bucket order, every bucket whose gradients are all there; then start the Q's whose P is in."""
        last = len(self.buckets) - (self.buckets[-1].name == ROWS_BUCKET)
        while len(self._flights) < last:
            bucket = self.buckets[len(self._flights)]
            if len(bucket.ready) < len(bucket.params):
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
            if not lost_peer(error):
                raise
            raise ExchangeError(self.waiting_on or "the end of the exchange", error) from error

    @torch.no_grad()
    def _finish(self) -> bool:
        assert self._active
        self._active = False
        ps = self.powersgd
        if self._stream is not None:  # the flags read gradients the side stream unscaled in place
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        named = [(n, p) for bucket in self.buckets for n, p in bucket.params]
        if dist.is_initialized():
            self.waiting_on = "the flag all-reduce (non-finite gradients, unused parameters, embedding rows)"
        grads = [local_shard(p.grad) for p in [*(p for _, p in named), *self._replicated] if p.grad is not None]
        whole = [p for _, p in named if not hasattr(p, "to_local")] + self._replicated
        rows = [RowSparse(n, None if p.grad is None else local_shard(p.grad), *self._row_sparse[n])
                for n, p in named if n in self._row_sparse]
        flags = agree_step_flags(grads, whole=whole, row_sparse=rows, group=self.flag_group)
        if flags.finite and self._replicated:
            self.waiting_on = "the all-reduce of the parameters left whole"
            flags.finite = average_whole(self._replicated)
        with self._side_stream():
            for bucket in self.buckets[len(self._flights):]:
                if flags.finite or bucket.name != ROWS_BUCKET:  # a skipped step still matches the others'
                    self._issue(bucket, flags.rows, skip_unused=True)
            self._progress(block=True)
        if self._stream is not None:  # the commit and the optimizer step read what the side stream wrote
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        flights, self._flights = self._flights, []
        if not flags.finite:
            ps.count_skip()
            return False
        sent = flags.row_mask_bytes if ps.replicas > 1 else 0
        for flight in flights:
            self._commit(flight)
            sent += flight.sent
        ps.count_step(sent, sum(local_shard(p.grad).numel() for _, p in named if p.grad is not None) * FP32_BYTES)
        return True

    # ------------------------------------------------------------------ a bucket's two collectives

    def _issue(self, bucket: Bucket, rows: dict[str, torch.Tensor], skip_unused: bool = False) -> None:
        """Stage a bucket's M and P and issue its P all-reduce (with its dense gradients on an fp32 wire)."""
        ps = self.powersgd
        if self._unscale is not None:  # per-block scales are fixed within a step: unscale as it is sent
            self._unscale([p for _, p in bucket.params if p.grad is not None])
        dense: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        low: list[LowRank] = []
        for name, p in bucket.params:
            if p.grad is None:
                if skip_unused:
                    continue  # no rank used it: left alone, as under ddp
                raise RuntimeError(f"bucket {bucket.name} issued without a gradient for {name}")
            g = local_shard(p.grad)
            if not g.numel():
                continue  # an empty shard (fewer rows than devices): nothing to send
            r = ps.rank_for(name, g.shape, self._uncompressed)
            if r:
                low.append(ps.form(name, g, r, staged=True))
            else:
                dense.append((name, g, rows.get(name)))
        flight = _Flight(bucket.name, dense, low)
        dense_parts = [(g if idx is None else g.index_select(0, idx.to(g.device))).reshape(-1).float()
                       for _, g, idx in dense]
        pts = [ps.p_factor(item).reshape(-1) for item in low]
        n_dense = sum(t.numel() for t in dense_parts)
        n_p = sum(t.numel() for t in pts)
        flight.sent = n_dense * FP32_BYTES + n_p * self._wire_bytes
        if ps.comm_dtype == torch.float32 or not low:
            flight.n_dense = n_dense
            flight.p_buf = torch.cat(dense_parts + pts) if dense_parts or pts else torch.zeros(0)
        else:
            flight.dense_buf = torch.cat(dense_parts) if dense_parts else None
            flight.p_buf = ps.to_wire(torch.cat(pts), ps.comm_dtype)
        for buf in (flight.dense_buf, flight.p_buf):
            if buf is not None and buf.numel():
                flight.works.append(dist.all_reduce(buf, group=self.p_group, async_op=True))
        self._flights.append(flight)

    @property
    def _wire_bytes(self) -> int:
        return torch.finfo(self.powersgd.comm_dtype).bits // 8

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
        flight.q_issued = True
        assert flight.p_buf is not None
        if flight.dense_buf is None:
            mean = ps.from_wire(flight.p_buf, torch.float32)
            flight.dense_mean, pts_flat = mean[:flight.n_dense], mean[flight.n_dense:]
        else:
            flight.dense_mean = ps.from_wire(flight.dense_buf, torch.float32)
            pts_flat = ps.from_wire(flight.p_buf, ps.comm_dtype)
        if not flight.low:
            return
        pts = pts_flat.split([item.rank * item.m.shape[0] for item in flight.low])
        qts = torch.cat([qt.reshape(-1) for qt in ps.q_factors(flight.low, pts)])
        flight.q_buf = ps.to_wire(qts, ps.comm_dtype)
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
        qflat = ps.from_wire(flight.q_buf, ps.comm_dtype)
        for item, qt in zip(flight.low, qflat.split([item.rank * item.m.shape[1] for item in flight.low])):
            ps.commit(item, qt)


def _row_span(p: nn.Parameter) -> tuple[int, int, int]:
    """(first row, rows held, rows of the whole table) of this rank's part of an embedding table: FSDP2 shards
    dim 0 in chunks of ceil(rows / devices); a whole table starts at 0."""
    rows = int(p.shape[0])
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return 0, rows, rows
    return min(mesh.get_local_rank() * -(-rows // mesh.size()), rows), int(local_shard(p).shape[0]), rows


@torch.no_grad()
def average_whole(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None = None) -> bool:
    """Average the gradients of parameters every rank holds whole over ``group`` (None: every rank; one
    all-reduce); False if one is non-finite (the same answer on every rank, as the values are then equal)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(flat, group=group)
        flat.div_(world)
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view(g.shape))
    return bool(finite_per_tensor([flat]).all())
