"""Orthogonalisation of PowerSGD's P factor by Householder QR, as the paper does.

Gram-Schmidt (the original PowerSGD choice) loses orthogonality when P's columns are nearly dependent, which
at scale happens often (e.g. gradients of rank < r). The paper instead takes a Householder QR of P + eps*I,
in fp32: Householder is backward stable, and the eps*I term makes a rank-deficient or zero P well defined
(the missing directions are filled by coordinate axes instead of by rounding noise).

eps is relative: each P gets eps times its own largest entry. The paper's absolute 1e-6 swamps small gradients (a P
whose entries are ~1e-6 is tilted by eps*I as much as it is itself, so even at full rank the reconstruction missed
the average by the gradient's own size); scaled, the tilt is the same share of P at any gradient magnitude. The
default, 1e-7, is just above fp32's unit roundoff (6e-8): the smallest tilt that still decides the directions a
rank-deficient or zero P lacks (coordinate axes, not rounding noise), while costing the full-rank reconstruction
no more than rounding does (worst 7.6e-7 of max|M| over 600 random tall M at 1, 1e-3 and 1e-6 scale; 1.4e-6 at 1e-6).

LAPACK's ``geqrf`` is exactly Householder QR (R in the upper triangle, the reflectors below it), and
``householder_product`` accumulates the reflectors into the thin Q. We flip column signs so that diag(R) >= 0,
which makes the result unique and identical to ``torch.linalg.qr`` up to rounding.
"""

from __future__ import annotations

import torch


def orthogonalize(p: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Return an fp32 matrix with orthonormal columns spanning the columns of ``p + eps*max|p|*I``.

    ``p`` has shape (..., n, r) with n >= r; ``I`` is the n x r identity (ones on the leading diagonal); ``max|p|``
    is each matrix's own largest magnitude (1 for a zero matrix), so eps is relative (module docstring).
    The input is not modified; any input dtype is computed in fp32 (LAPACK has no 16-bit kernels).
    """
    if p.ndim < 2:
        raise ValueError(f"orthogonalize expects a matrix (..., n, r), got shape {tuple(p.shape)}")
    n, r = p.shape[-2], p.shape[-1]
    if r > n:
        raise ValueError(f"orthogonalize expects n >= r (a tall P), got shape {tuple(p.shape)}")
    a = p.to(torch.float32, copy=True)
    scale = a.abs().amax(dim=(-2, -1)).unsqueeze(-1)  # (..., 1): each matrix's own magnitude, no host sync
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    a.diagonal(dim1=-2, dim2=-1).add_(eps * scale)  # + eps * max|p| * I without allocating I
    reflectors, tau = torch.geqrf(a)
    q = torch.linalg.householder_product(reflectors, tau)
    signs = torch.sign(torch.diagonal(reflectors, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs.unsqueeze(-2)


def orthogonalize_all(ps: list[torch.Tensor], eps: float = 1e-7) -> list[torch.Tensor]:
    """:func:`orthogonalize` for each matrix of ``ps``, one batched QR per distinct shape.

    A model repeats a few weight shapes over its layers; one LAPACK call per shape instead of one per matrix
    saves the per-call overhead that dominates for P factors of a few columns.
    """
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(ps):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(ps)
    for indices in by_shape.values():
        if len(indices) == 1:
            out[indices[0]] = orthogonalize(ps[indices[0]], eps)
            continue
        for i, q in zip(indices, orthogonalize(torch.stack([ps[i] for i in indices]), eps).unbind()):
            out[i] = q
    return out
