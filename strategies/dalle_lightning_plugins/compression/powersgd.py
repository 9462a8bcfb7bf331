"""PowerSGD: low-rank averaging of local gradient shards between nodes, as in DALL-E's distributed training.

Inside a node, FSDP reduce-scatters gradients so each device holds its own shard averaged over the node. Between
nodes the bandwidth is far lower, so the shard is averaged over the "replicate" group (the devices with the
same shard index on every node) through a rank-r approximation: for each gradient matrix M (n x m)

    M <- grad + e                      (error feedback: what earlier approximations missed)
    P <- mean over replicas of M Q     (Q: m x r, a fixed Gaussian identical on every replica)
    P <- orthonormal basis of P + eps*max|P|*I   (Householder QR, fp32; eps relative to P)
    Q' <- mean over replicas of M^T P
    grad <- P Q'^T;  e <- M - P Q'^T

so each replica sends r(n + m) numbers instead of n m. All P's of a step travel in ONE flat all-reduce and all
Q's in ONE more; vectors, embeddings and matrices too small to gain go uncompressed in fp32, in a third (or in
P's, with ``dense_with_p`` and an fp32 wire). Before them, a one-element all-reduce over all ranks decides
whether any gradient anywhere is non-finite, in which case nothing is communicated or modified and every rank
skips the update (the paper skips ~5% of updates); a caller with a collective of its own at that point can agree
on it there and pass the answer (``reduce(..., finite=)``). Each collective is also a point where one rank
waits for the others, so on a link whose latency outweighs these bytes (gloo on one host: 0.2 ms for one
element, 0.7 ms for the demo prior's P buffer) fewer collectives are what makes the exchange cheaper.

The class works on plain tensors and process groups only, so any strategy (or none) can call it once per
optimizer step. Without an initialised process group it behaves as a single replica.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from dalle_lightning_plugins.compression.comm_dtype import from_comm, resolve_comm_dtype, to_comm
from dalle_lightning_plugins.compression.householder import orthogonalize_all
from dalle_lightning_plugins.compression.step_flags import agree_step_flags, finite_per_tensor

FP32_BYTES = 4
# The strategy's rank when neither a rank nor a compression is given; docs/results.md ("time to loss") says how
# it was chosen.
DEFAULT_RANK = 32


def plan_rank(shape: Sequence[int], rank: int, min_compression: float) -> int:
    """Effective PowerSGD rank for a gradient of ``shape``, or 0 when it should be all-reduced uncompressed.

    A gradient with ndim >= 2 is the matrix (shape[0], prod(shape[1:])); it is compressed with rank
    min(rank, n, m) unless that would not shrink it by at least ``min_compression`` (n m < c r (n + m)).
    """
    if len(shape) < 2:
        return 0
    n, m = int(shape[0]), math.prod(int(s) for s in shape[1:])
    if n == 0 or m == 0:
        return 0
    r = min(rank, n, m)
    if n * m < min_compression * r * (n + m):
        return 0
    return r


def saved_share(shapes: Sequence[Sequence[int]], rank: int, min_compression: float) -> float:
    """The share of the compressed matrices' fp32 bytes that rank ``rank`` saves (0.0 when none is compressed):
    1 - sum r (n + m) / sum n m over the matrices :func:`plan_rank` compresses, the paper's "compression"."""
    full = low = 0
    for shape in shapes:
        r = plan_rank(shape, rank, min_compression)
        if r:
            n, m = int(shape[0]), math.prod(int(s) for s in shape[1:])
            full, low = full + n * m, low + r * (n + m)
    return 1.0 - low / full if full else 0.0


def rank_for_compression(shapes: Sequence[Sequence[int]], compression: float, min_compression: float) -> int:
    """The largest rank that still saves at least ``compression`` of the compressed matrices' bytes.

    The paper states its setting this way (86% at its 12B model); the rank that achieves it depends on the
    matrices, so it is derived from the gradient shapes. Raises when no rank saves that much.
    """
    largest = max((min(int(s[0]), math.prod(int(x) for x in s[1:])) for s in shapes if len(s) >= 2), default=0)
    best = 0
    for r in range(1, largest + 1):
        if saved_share(shapes, r, min_compression) >= compression:
            best = r
    if not best:
        raise ValueError(f"compression={compression!r} is out of reach: rank 1 saves "
                         f"{saved_share(shapes, 1, min_compression):.4f} of the compressed matrices' bytes")
    return best


def factor_bytes(n: int, m: int, r: int, comm_dtype: torch.dtype) -> int:
    """Bytes one replica contributes for one compressed n x m matrix: P (n x r) plus Q' (m x r)."""
    return r * (n + m) * torch.finfo(comm_dtype).bits // 8


def _fixed_gaussian(name: str, seed: int, rows: int, cols: int) -> torch.Tensor:
    """A Gaussian matrix determined by (seed, name) only, so every replica draws the same one without talking."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32)


@dataclass
class LowRank:
    """One compressed gradient between the stages of :class:`PowerSGD`: the gradient, its rank, M and P."""

    name: str
    grad: torch.Tensor  # written by ``commit``
    rank: int
    m: torch.Tensor  # M = grad + e, fp32, (n, m)
    p: torch.Tensor | None = None  # the orthonormal P, (n, r), once ``q_factors`` has run


@dataclass
class PowerSGDStats:
    """Counters for logging. Bytes are those of the flat buffers this rank contributes to inter-node all-reduces
    (gradient traffic only; the 4-byte skip flag is not counted). ``uncompressed`` is what a plain fp32
    all-reduce of the same gradients would contribute. A skipped step sends nothing and counts 0 bytes."""

    steps: int = 0
    skipped_steps: int = 0
    bytes_sent_last_step: int = 0
    uncompressed_bytes_last_step: int = 0
    bytes_sent_total: int = 0
    uncompressed_bytes_total: int = 0

    @property
    def compression_ratio(self) -> float:
        """Uncompressed over sent bytes, cumulative over all steps (1.0 before anything was sent)."""
        return self.uncompressed_bytes_total / self.bytes_sent_total if self.bytes_sent_total else 1.0

    def record_skip(self) -> None:
        """Count a step skipped for a non-finite gradient, found here or by the caller before reducing."""
        self.steps += 1
        self.skipped_steps += 1
        self.record(0, 0)

    def record(self, sent: int, uncompressed: int) -> None:
        """The bytes of one step (taken or skipped): the last step's and the running totals."""
        self.bytes_sent_last_step, self.uncompressed_bytes_last_step = sent, uncompressed
        self.bytes_sent_total += sent
        self.uncompressed_bytes_total += uncompressed


class PowerSGD:
    """Averages local gradient shards over ``group`` with PowerSGD; see the module docstring.

    Args:
        group: the replicate process group (same shard index on every node); None means WORLD.
        rank: target rank r per matrix (capped at min(n, m)).
        start_step: number of first successful steps that use a plain fp32 all-reduce instead.
        warm_start: reuse the previous step's Q' as Q (the paper keeps a fixed Q; resampling hurt there).
        error_feedback: keep per-matrix fp32 error buffers and add them to the next gradient.
        comm_dtype: wire dtype of P and Q' (fp32, bf16 or fp16; infinities clamped to the format's max).
        eps: the relative eps of the Householder QR of P + eps*max|P|*I (householder.py).
        min_compression: compress a matrix only if it shrinks by at least this factor.
        seed: seeds the fixed Q of each matrix together with its name.
        skip_group: group over which "any non-finite gradient" is agreed; None means WORLD, so every shard of
            the model skips together and parameters stay consistent.
        dense_with_p: with an fp32 wire, send the uncompressed gradients in P's all-reduce instead of a third
            one (off: each kind in its own collective, whose sizes are easier to read in a trace).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        rank: int = 4,
        start_step: int = 0,
        warm_start: bool = False,
        error_feedback: bool = True,
        comm_dtype: torch.dtype | str = torch.float32,
        eps: float = 1e-7,
        min_compression: float = 2.0,
        seed: int = 0,
        skip_group: dist.ProcessGroup | None = None,
        dense_with_p: bool = False,
    ) -> None:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive integer")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step={start_step!r} must be a non-negative integer")
        if not eps >= 0:
            raise ValueError(f"eps={eps!r} must be >= 0")
        if not min_compression >= 0:
            raise ValueError(f"min_compression={min_compression!r} must be >= 0")
        self.group, self.skip_group = group, skip_group
        self.dense_with_p = dense_with_p
        self.rank, self.start_step, self.seed = rank, start_step, seed
        self.warm_start, self.error_feedback = warm_start, error_feedback
        self.comm_dtype = resolve_comm_dtype(comm_dtype)
        self.eps, self.min_compression = eps, min_compression
        self.stats = PowerSGDStats()
        self._step = 0  # successful (non-skipped) reductions; drives start_step
        self._q: dict[str, torch.Tensor] = {}
        self._error: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}  # last step's error buffers: where the next staged M is formed

    # ------------------------------------------------------------------ public API

    @property
    def replicas(self) -> int:
        """Size of the averaging group (1 without a process group): how many copies of each shard exist."""
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def reduce(self, named_grads: Sequence[tuple[str, torch.Tensor]], uncompressed: Collection[str] = (),
               finite: bool | None = None) -> bool:
        """Average each local gradient in place over ``group``; return False when the step must be skipped.

        Skipping happens when any gradient on any rank of ``skip_group`` is non-finite; every rank gets the same
        answer, and then no gradient, error buffer or Q is touched. Every replica in ``group`` must pass the
        same names and shapes in the same order. ``finite``: that answer, when the caller has already agreed on
        it over ``skip_group`` (:func:`~dalle_lightning_plugins.compression.step_flags.agree_step_flags`); None agrees here,
        with a collective of its own.
        """
        named = list(named_grads)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError(f"reduce() got duplicate gradient names: {sorted({n for n in names if names.count(n) > 1})}")
        if finite is None:
            finite = agree_step_flags([g for _, g in named], group=self.skip_group).finite
        if not finite:
            self.count_skip()
            return False
        if self.replicas == 1:
            # Nobody to average with (one node): the gradients are already exact; compressing them would only
            # add approximation error, and no byte crosses a node.
            self.count_step(0, 0)
            return True
        listed = set(uncompressed)
        dense: list[torch.Tensor] = []
        low_rank: list[LowRank] = []
        for name, g in named:
            r = self.rank_for(name, g.shape, listed)
            if r:
                low_rank.append(self.form(name, g, r, staged=False))
            else:
                dense.append(g)
        if self.dense_with_p and low_rank and self.comm_dtype == torch.float32:
            sent = self._reduce_low_rank(low_rank, riders=dense)  # one collective fewer
        else:
            sent = self._reduce_dense(dense) + self._reduce_low_rank(low_rank)
        self.count_step(sent, sum(g.numel() for _, g in named) * FP32_BYTES)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state: Q matrices, fp32 error buffers, step counter and statistics (all cloned)."""
        return {
            "step": self._step,
            "rank": self.rank,
            "seed": self.seed,
            "q": {k: v.detach().clone() for k, v in self._q.items()},
            "error": {k: v.detach().clone() for k, v in self._error.items()},
            "stats": asdict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses state made with another rank or seed (its Q would differ)."""
        for key in ("rank", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"PowerSGD state has {key}={state[key]!r}, but this compressor has {getattr(self, key)!r}")
        self._step = int(state["step"])
        self._q = {k: v.detach().clone().float() for k, v in state["q"].items()}
        self._error = {k: v.detach().clone().float() for k, v in state["error"].items()}
        self._spare = {}
        self.stats = PowerSGDStats(**state["stats"])

    # ------------------------------------------------------------------ the stages of one matrix
    #
    # Every path that averages with PowerSGD (``reduce`` below, the overlapped exchange in exchange.py) runs the
    # same four stages per compressed matrix, with its own collectives in between:
    #   form -> p_factor -> [all-reduce P^T] -> q_factors -> [all-reduce Q'^T] -> commit
    # The factors are computed transposed, P^T = Q^T M^T and Q'^T = P^T M: the same numbers, but a product with
    # r rows runs 4-6x faster on CPU BLAS (MKL) than one with r columns (M Q).

    def rank_for(self, name: str, shape: Sequence[int], uncompressed: Collection[str] = ()) -> int:
        """This step's rank for gradient ``name`` (0: averaged uncompressed): plain all-reduces during the
        first ``start_step`` successful steps, and for names listed ``uncompressed``."""
        if self._step < self.start_step or name in uncompressed:
            return 0
        return plan_rank(shape, self.rank, self.min_compression)

    def form(self, name: str, g: torch.Tensor, r: int, *, staged: bool) -> LowRank:
        """Stage 1: M = g + e (fp32, (n, prod(rest))). ``staged``: in a new tensor, the error buffer untouched
        until :meth:`commit` (for a caller that decides the skip later); else in the error buffer itself."""
        g2 = g.reshape(g.shape[0], -1)
        if not self.error_feedback:
            m = g2.float()
        elif staged:  # in the spare buffer (the error buffer it replaced at the last commit): no allocation
            error = self._error_buffer(name, g2.shape, g.device)
            spare = self._spare.get(name)
            if spare is None or spare.shape != error.shape or spare.device != error.device or spare is error:
                spare = self._spare[name] = torch.empty_like(error)
            m = torch.add(error, g2, out=spare)
        else:
            m = self._error_buffer(name, g2.shape, g.device).add_(g2)
        return LowRank(name, g, r, m)

    def p_factor(self, item: LowRank) -> torch.Tensor:
        """Stage 2: this replica's P^T = Q^T M^T, (r, n), to be averaged over the replicas."""
        return self._fixed_q(item.name, item.m.shape[1], item.rank, item.m.device).T @ item.m.T

    def q_factors(self, items: Sequence[LowRank], mean_pts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Stage 3: orthogonalise each averaged P (one batched Householder QR per shape, kept on the item) and
        return this replica's Q'^T = P^T M, (r, m) each, to be averaged over the replicas."""
        ps = orthogonalize_all([pt.view(item.rank, item.m.shape[0]).T for item, pt in zip(items, mean_pts)], self.eps)
        for item, p in zip(items, ps):
            item.p = p
        return [p.T @ item.m for item, p in zip(items, ps)]

    @torch.no_grad()
    def commit(self, item: LowRank, mean_qt: torch.Tensor) -> None:
        """Stage 4: gradient <- P Q'^T; error <- M - P Q'^T (zeroed once contaminated: the paper's rule, without a
        host synchronisation); with ``warm_start``, Q <- Q'. Only for a step that is taken."""
        assert item.p is not None, "commit() before q_factors()"
        m, g = item.m, item.grad
        qt = mean_qt.view(item.rank, m.shape[1])
        if g.is_contiguous() and g.dtype == torch.float32:
            approx = torch.mm(item.p, qt, out=g.view(m.shape))  # straight into the gradient, no temporary
        else:
            approx = item.p @ qt
            g.copy_(approx.view(g.shape))
        if self.error_feedback:
            m.sub_(approx)
            m.masked_fill_(~finite_per_tensor([m])[0], 0.0)
            if self._error[item.name] is not m:  # staged: M becomes the error buffer, the old one the spare
                self._spare[item.name] = self._error[item.name]
                self._error[item.name] = m
        if self.warm_start:
            self._q[item.name] = qt.T.clone()

    def count_step(self, sent: int, uncompressed: int) -> None:
        """A taken step: ``sent`` bytes this rank contributed, ``uncompressed`` those of a plain fp32 average."""
        self.stats.steps += 1
        self.stats.record(sent, uncompressed)
        self._step += 1

    def count_skip(self) -> None:
        """A step skipped for a non-finite gradient (nothing sent, nothing committed)."""
        self.stats.record_skip()

    # ------------------------------------------------------------------ the wire

    def to_wire(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The buffer to sum over the replicas so that :meth:`from_wire` gives the mean: fp32 as is; a 16-bit wire
        divided by the replicas first and clamped, so the sum cannot overflow the format."""
        if dtype == torch.float32:
            return flat
        return to_comm(flat / self.replicas, dtype, summands=self.replicas)

    def from_wire(self, summed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 mean from a buffer :meth:`to_wire` made and the replicas summed."""
        return summed.div_(self.replicas) if dtype == torch.float32 else from_comm(summed)

    def _mean_all_reduce(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Mean of fp32 ``flat`` over ``group``, sent as ``dtype``."""
        if self.replicas == 1:
            return flat
        wire = self.to_wire(flat, dtype)
        if dist.is_initialized():  # else a test that only counts bytes
            dist.all_reduce(wire, group=self.group)
        return self.from_wire(wire, dtype)

    # ------------------------------------------------------------------ the end-of-backward path

    def _reduce_dense(self, grads: list[torch.Tensor]) -> int:
        """One flat fp32 all-reduce for every uncompressed gradient; returns the bytes sent."""
        numel = sum(g.numel() for g in grads)
        if numel == 0:
            return 0
        flat = self._mean_all_reduce(torch.cat([g.reshape(-1).float() for g in grads]), torch.float32)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view(g.shape))
        return numel * FP32_BYTES

    def _reduce_low_rank(self, items: list[LowRank], riders: Sequence[torch.Tensor] = ()) -> int:
        """The stages for every compressed gradient, with one grouped all-reduce for P and one for Q'; returns the
        bytes sent. ``riders``: uncompressed gradients averaged in P's all-reduce (fp32 wire only)."""
        if not items:
            return 0
        first = self._grouped_mean([g.reshape(-1).float() for g in riders] + [self.p_factor(i) for i in items])
        for g, mean in zip(riders, first):
            g.copy_(mean.view(g.shape))
        qts = self._grouped_mean(self.q_factors(items, first[len(riders):]))
        for item, qt in zip(items, qts):
            self.commit(item, qt)
        n_factor = sum(t.numel() for t in first[len(riders):]) + sum(q.numel() for q in qts)
        return n_factor * torch.finfo(self.comm_dtype).bits // 8 + sum(g.numel() for g in riders) * FP32_BYTES

    def _grouped_mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = self._mean_all_reduce(torch.cat([t.reshape(-1) for t in tensors]), self.comm_dtype)
        return [c.view(t.shape) for t, c in zip(tensors, flat.split([t.numel() for t in tensors]))]

    # ------------------------------------------------------------------ state

    def _fixed_q(self, name: str, cols: int, r: int, device: torch.device) -> torch.Tensor:
        """The Q of ``name`` (m x r): the fixed Gaussian, or last step's Q' with ``warm_start``."""
        if name not in self._q:
            self._q[name] = _fixed_gaussian(name, self.seed, cols, r)
        q = self._q[name]
        if q.shape != (cols, r):
            raise ValueError(f"PowerSGD Q for {name!r} has shape {tuple(q.shape)}, expected {(cols, r)}; did the gradient shape change?")
        if q.device != device:
            q = self._q[name] = q.to(device)
        return q

    def _error_buffer(self, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The fp32 error buffer of ``name`` (zeros the first time)."""
        if name not in self._error:
            self._error[name] = torch.zeros(shape, dtype=torch.float32, device=device)
        buf = self._error[name]
        if buf.shape != shape:
            raise ValueError(f"PowerSGD error buffer for {name!r} has shape {tuple(buf.shape)}, expected {tuple(shape)}")
        if buf.device != device:
            buf = self._error[name] = buf.to(device)
        return buf
