"""The DALL-E stage-two prior: a decoder-only sparse transformer over one stream of text then image tokens.

Stream layout (our choice, documented here because every other part depends on it)::

    position   0       1 .. T             T+1 .. T+N
    token      <start> t_0 .. t_{T-1}     i_0 .. i_{N-1}

``<start>`` is a learned vector, so the first caption token is predicted too. The *text region* is the start
plus the ``T = text_len`` caption positions (``n_text = T + 1``); the *image region* is the ``N = grid^2`` image
tokens in raster order. The hidden state at position ``p`` predicts the token at ``p + 1``; the last image token
is never an input. Image masks (row / column / conv) are defined on the input positions (the token a query
holds), exactly as in :mod:`dalle_lightning.models.layout`.

Text ids use ``0`` for padding. Each text position ``i`` has its own learned padding embedding, row
``text_vocab_size + i`` of the text embedding. On the output side the text head predicts the raw id, so class
``0`` means "the caption has ended here"; padding positions count in the text loss like any other text token.

Two heads (text ``text_vocab_size`` classes, image ``image_vocab_size`` classes), computed in fp32 even under
autocast. Each layer has two named residual branches, ``layers.<i>.attn`` and ``layers.<i>.mlp``, each with its
own pre-LayerNorm; :meth:`DallePrior.resblocks` lists them for the sharding strategy and the precision plugin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dalle_lightning.models.layout import ATTENTION_KINDS, AttentionLayout, layer_pattern
from dalle_lightning.models.regions import CompiledRegion, CompileMode, check_compile, wants_compiled
from dalle_lightning.models.sparse_attention import ATTENTION_IMPLS, attention, decode_attention

TEXT_LOSS_WEIGHT = 1.0 / 8.0  # paper: 1/8 text + 7/8 image


@dataclass
class LayerKV:
    """Keys and values ``[2, B, H, max_len, D]`` of one layer (one tensor, so decoding gathers once), allocated on
    first write with the keys' dtype. Zeros, not garbage: masked positions still meet ``0 * value`` in the matmul."""

    max_len: int
    kv: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor) -> None:
        """Keys and values ``[B, H, n, D]`` at positions ``start ..``; a one-element tensor ``start`` (one position,
        ``n = 1``) writes in place at a position the device holds, without a host value (a CUDA graph's step)."""
        if self.kv is None:
            self.kv = k.new_zeros((2, *k.shape[:2], self.max_len, k.shape[-1]))
        if isinstance(start, torch.Tensor):
            self.kv.index_copy_(3, start.view(1), torch.stack((k, v)).to(self.kv.dtype))
            return
        end = start + k.shape[-2]
        self.kv[0, :, :, start:end] = k
        self.kv[1, :, :, start:end] = v


@dataclass
class KVCache:
    """Per-layer key/value buffers plus how many stream positions they hold."""

    layers: list[LayerKV] = field(default_factory=list)
    length: int = 0


class AttentionBranch(nn.Module):
    """Residual branch ``LN -> multi-head masked attention -> projection`` (the caller adds it to the stream).

    Compiled (``compile_mode``), the two regions around the attention kernel are compiled, the kernel itself
    runs as :func:`attention` dispatches it (FlexAttention compiled on its own, once per dtype for every layout),
    so the layer's layout never enters the regions' guards and every layer shares their graphs."""

    def __init__(self, d_model: int, n_head: int, d_head: int, layout: AttentionLayout, impl: str, dropout: float,
                 compile_mode: CompileMode = False):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.layout, self.impl = layout, impl
        self.compile_mode = check_compile(compile_mode)
        self.ln = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * n_head * d_head)
        self.proj = nn.Linear(n_head * d_head, d_model)
        self.drop = nn.Dropout(dropout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length, _ = x.shape
        qkv = self.qkv(self.ln(x)).view(b, length, 3, self.n_head, self.d_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, D]
        return q, k, v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, _, length, _ = y.shape
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, length, self.n_head * self.d_head)))

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        compiled = wants_compiled(self.compile_mode, x)
        q, k, v = _QKV(self, x) if compiled else self._qkv(x)
        if kv is not None:
            kv.write(k, v, 0)
        y = attention(q, k, v, self.layout, self.impl)
        return _OUT(self, y) if compiled else self._out(y)

    def decode(self, x: torch.Tensor, kv: LayerKV, pos: int | torch.Tensor) -> torch.Tensor:
        """One new image position ``pos`` (``x: [B, 1, d]``; an int, or a one-element tensor on the device) against
        the cache: O(its mask row)."""
        q, k, v = self._qkv(x)
        kv.write(k, v, pos)
        assert kv.kv is not None
        # The cache keeps the dtype of the prefill, which may have run under autocast (bf16 branches) while this
        # call, not a forward, runs outside it: attend in the cache's dtype, project in the query's.
        y = decode_attention(q.to(kv.kv.dtype), kv.kv, self.layout, pos - self.layout.n_text)
        return self._out(y.to(q.dtype))


_QKV = CompiledRegion(AttentionBranch._qkv)
_OUT = CompiledRegion(AttentionBranch._out)


class MlpBranch(nn.Module):
    """Residual branch ``LN -> Linear -> GELU -> Linear``, compiled whole under ``compile_mode``."""

    def __init__(self, d_model: int, mlp_ratio: int, dropout: float, compile_mode: CompileMode = False):
        super().__init__()
        self.compile_mode = check_compile(compile_mode)
        self.ln = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MLP(self, x) if wants_compiled(self.compile_mode, x) else self._body(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(self.ln(x)))))


_MLP = CompiledRegion(MlpBranch._body)


class Layer(nn.Module):
    """Pre-LN transformer layer: ``x = x + attn(x); x = x + mlp(x)``."""

    def __init__(self, d_model: int, n_head: int, d_head: int, mlp_ratio: int, layout: AttentionLayout, impl: str,
                 dropout: float, compile_mode: CompileMode = False):
        super().__init__()
        self.attn = AttentionBranch(d_model, n_head, d_head, layout, impl, dropout, compile_mode)
        self.mlp = MlpBranch(d_model, mlp_ratio, dropout, compile_mode)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attn(x, kv)
        return x + self.mlp(x)

    def decode(self, x: torch.Tensor, kv: LayerKV, pos: int | torch.Tensor) -> torch.Tensor:
        x = x + self.attn.decode(x, kv, pos)
        return x + self.mlp(x)


def _check_ids(*checks: tuple[str, torch.Tensor, int]) -> None:
    """Each ``(kind, ids, vocab)``: ids within ``[0, vocab)``, read back in one host sync for all of them (an
    accelerator waits at each read, so the text and image checks of a forward share one)."""
    present = [(kind, ids, vocab) for kind, ids, vocab in checks if ids.numel()]
    if not present:
        return
    bounds = torch.stack([torch.stack(ids.aminmax()).long() for _, ids, _ in present]).tolist()
    for (kind, _, vocab), (lo, hi) in zip(present, bounds):
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{kind} ids in [{lo}, {hi}]; expected [0, {vocab})")


def _pattern(attn_pattern: str | Sequence[str], n_layer: int) -> list[str]:
    if isinstance(attn_pattern, str):
        kinds = layer_pattern(n_layer) if attn_pattern == "paper" else [s.strip() for s in attn_pattern.split(",")]
    else:
        kinds = [str(s) for s in attn_pattern]
    if len(kinds) != n_layer or any(k not in ATTENTION_KINDS for k in kinds):
        raise ValueError(
            f"attn_pattern={attn_pattern!r}; expected 'paper' or {n_layer} kinds from {ATTENTION_KINDS}"
        )
    return kinds


class DallePrior(nn.Module):
    """Text+image sparse transformer prior (see the module docstring for the stream layout).

    ``attn_impl``: ``auto`` (FlexAttention on CUDA, the blocked kernel elsewhere), ``sparse``, ``flex`` or
    ``dense`` (the reference). ``compile``: compile each residual branch's body (:mod:`dalle_lightning.models.regions`):
    ``True``, ``False`` or ``"auto"`` (where the inputs are on CUDA).
    """

    def __init__(
        self,
        text_vocab_size: int,
        text_len: int,
        image_vocab_size: int,
        image_grid: int,
        n_layer: int,
        n_head: int,
        d_head: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        row_window: int | None = None,
        conv_kernel: int | None = None,
        attn_pattern: str | Sequence[str] = "paper",
        attn_impl: str = "auto",
        compile: CompileMode = False,  # noqa: A002 - the config key users set
    ):
        super().__init__()
        for name, value in dict(text_vocab_size=text_vocab_size, text_len=text_len, image_vocab_size=image_vocab_size,
                                image_grid=image_grid, n_layer=n_layer, n_head=n_head, d_head=d_head).items():
            if value < 1:
                raise ValueError(f"{name}={value}; expected a positive integer")
        if attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}; expected one of {ATTENTION_IMPLS}")
        compile_mode = check_compile(compile)
        self.text_vocab_size, self.text_len = text_vocab_size, text_len
        self.image_vocab_size, self.image_grid = image_vocab_size, image_grid
        self.n_text = text_len + 1  # start vector + caption positions
        self.image_len = image_grid * image_grid
        self.max_len = self.n_text + self.image_len
        d_model = n_head * d_head
        self.d_model = d_model

        self.bos = nn.Parameter(torch.zeros(d_model))
        self.text_emb = nn.Embedding(text_vocab_size + text_len, d_model)  # + one padding row per position
        self.text_pos = nn.Embedding(text_len, d_model)
        self.image_emb = nn.Embedding(image_vocab_size, d_model)
        self.row_emb = nn.Embedding(image_grid, d_model)
        self.col_emb = nn.Embedding(image_grid, d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            Layer(d_model, n_head, d_head, mlp_ratio,
                  AttentionLayout(kind, self.n_text, image_grid, image_grid, row_window, conv_kernel),
                  attn_impl, dropout, compile_mode)
            for kind in _pattern(attn_pattern, n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.text_head = nn.Linear(d_model, text_vocab_size, bias=False)
        self.image_head = nn.Linear(d_model, image_vocab_size, bias=False)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 n_layer) so the stream's
        variance does not grow with depth."""
        for name, p in self.named_parameters():
            if p.dim() >= 2 or name == "bos":
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    # ------------------------------------------------------------------------------------------ structure
    def resblocks(self) -> list[tuple[str, nn.Module]]:
        """The residual branches, two per layer, for the strategy (shards) and precision plugin (scales)."""
        out: list[tuple[str, nn.Module]] = []
        for i, layer in enumerate(self.layers):
            out += [(f"layers.{i}.attn", layer.attn), (f"layers.{i}.mlp", layer.mlp)]
        return out

    def attention_types(self) -> list[str]:
        return [layer.attn.layout.kind for layer in self.layers]

    # ------------------------------------------------------------------------------------------ embedding
    def _check(self, text: torch.Tensor, image: torch.Tensor | None, max_image: int) -> None:
        if text.dim() != 2 or text.shape[1] != self.text_len:
            raise ValueError(f"text of shape {tuple(text.shape)}; expected [batch, {self.text_len}]")
        if image is None:
            _check_ids(("text", text, self.text_vocab_size))
            return
        if image.dim() != 2 or image.shape[0] != text.shape[0] or image.shape[1] > max_image:
            raise ValueError(
                f"image tokens of shape {tuple(image.shape)}; expected [{text.shape[0]}, <= {max_image}]"
            )
        _check_ids(("text", text, self.text_vocab_size), ("image", image, self.image_vocab_size))

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """``[B, T] -> [B, T, d]``: id 0 at position ``i`` becomes that position's own padding row."""
        pos = torch.arange(self.text_len, device=text.device)
        ids = torch.where(text == 0, self.text_vocab_size + pos, text)
        return self.text_emb(ids) + self.text_pos(pos)

    def embed_image(self, image: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """``[B, n] -> [B, n, d]`` for image tokens at raster indices ``start .. start + n - 1`` (``start`` may be a
        one-element tensor on the device)."""
        pos = start + torch.arange(image.shape[1], device=image.device)
        return self.image_emb(image) + self.row_emb(pos // self.image_grid) + self.col_emb(pos % self.image_grid)

    def _embed(self, text: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        parts = [self.bos.expand(text.shape[0], 1, -1), self.embed_text(text)]
        if image is not None and image.shape[1] > 0:
            parts.append(self.embed_image(image))
        return self.drop(torch.cat(parts, dim=1))

    def _heads(self, h: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """Logits in fp32 even under autocast (the paper keeps unembeddings and logits in fp32)."""
        with torch.autocast(device_type=h.device.type, enabled=False):
            return F.linear(self.ln_f(h.float()), head.weight.float())

    # ------------------------------------------------------------------------------------------ training
    def logits(
        self, text: torch.Tensor, image: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text_logits [B, T, Vt], image_logits [B, m, Vi])`` for ``n`` given image tokens, ``m = min(n + 1, N)``:
        image logit ``j`` predicts image token ``j``. With a ``cache`` the keys/values are stored for decoding."""
        self._check(text, image, self.image_len)
        x = self._embed(text, image)
        if cache is not None:
            cache.layers = [LayerKV(self.max_len) for _ in self.layers]
            cache.length = x.shape[1]
        for i, layer in enumerate(self.layers):
            x = layer(x, cache.layers[i] if cache is not None else None)
        t = self.text_len
        n = 0 if image is None else image.shape[1]
        m = min(n + 1, self.image_len)
        return self._heads(x[:, :t], self.text_head), self._heads(x[:, t : t + m], self.image_head)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss on a batch: ``text [B, T]`` (0 = padding), ``image [B, N]`` codes in raster order."""
        if image.dim() != 2 or image.shape[1] != self.image_len:
            raise ValueError(f"image tokens of shape {tuple(image.shape)}; expected [batch, {self.image_len}]")
        text_logits, image_logits = self.logits(text, image[:, :-1])
        text_loss = F.cross_entropy(text_logits.reshape(-1, self.text_vocab_size), text.reshape(-1))
        image_loss = F.cross_entropy(image_logits.reshape(-1, self.image_vocab_size), image.reshape(-1))
        loss = TEXT_LOSS_WEIGHT * text_loss + (1.0 - TEXT_LOSS_WEIGHT) * image_loss
        return {"loss": loss, "text_loss": text_loss, "image_loss": image_loss}

    # ------------------------------------------------------------------------------------------ sampling
    def prefill(self, text: torch.Tensor, image: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        """Run the prompt (caption + optional image prefix) once, fill ``cache``; return the fp32 logits
        ``[B, Vi]`` of the next image token."""
        n = 0 if image is None else image.shape[1]
        if n >= self.image_len:
            raise ValueError(f"image prefix of {n} tokens; expected fewer than {self.image_len} to leave one to sample")
        return self.logits(text, image, cache)[1][:, -1]

    def decode(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one image token ``[B]`` at the next position of ``cache``; return the next token's logits."""
        pos = cache.length
        n = pos - self.n_text
        if not 0 <= n < self.image_len - 1:
            raise ValueError(f"cache holds {pos} positions; expected {self.n_text} .. {self.max_len - 2} to decode")
        logits = self.decode_at(token, n, cache)  # a host int: no device value to read or copy per token
        cache.length = pos + 1
        return logits

    def decode_at(self, token: torch.Tensor, image_pos: int | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """:meth:`decode` at image position ``image_pos``, without checks and without moving ``cache.length``. Given
        as a one-element tensor on the device, the step runs the same kernels with the same shapes at every position
        and reads no host value, so one CUDA graph replays it for every token
        (``dalle_lightning.generation.graph_decode``)."""
        x = self.embed_image(token.view(-1, 1), start=image_pos)
        pos = image_pos + self.n_text
        for layer, kv in zip(self.layers, cache.layers):
            x = layer.decode(x, kv, pos)
        return self._heads(x[:, -1], self.image_head)
