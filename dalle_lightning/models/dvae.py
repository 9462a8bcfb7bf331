"""The discrete VAE of DALL-E (stage 1): images <-> a grid of K-way codes.

Architecture as in OpenAI's released ``dall_e`` package (module names mirror theirs so their state dicts
map one to one, see ``dvae_convert.py``), built from plain ``nn.Conv2d``:

- Encoder: 7x7 conv -> ``group_count`` groups of bottleneck resblocks (widths n_hid * 1, 2, 4, 8, ...) with a
  2x2 max-pool after every group but the last -> ReLU -> 1x1 conv to K logits. A block's residual path is a
  quarter of its width (the paper); ``block_min_hidden`` widens the narrowest ones, those at full resolution,
  where a small model otherwise draws every edge through 8 channels (docs/experiments.md).
- Decoder: 1x1 conv from the (relaxed) one-hot over K to ``codebook_dim`` channels (this conv *is* the
  codebook) -> groups with widths ... 8, 4, 2, 1 * n_hid and nearest 2x upsampling -> ReLU -> 1x1 conv to
  2 * C channels: the logit-Laplace location mu and log-scale ln b for each colour channel.

Training maximises the ELB with a Gumbel-softmax relaxation of q(z|x) and a logit-Laplace likelihood over
pixels squeezed into (eps, 1 - eps); both terms are normalised by the number of pixel values (the paper's
256 * 256 * 3), so beta means the same thing at every image size.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from dalle_lightning.models.regions import CompiledRegion, CompileMode, check_compile, wants_compiled

LOGIT_LAPLACE_EPS = 0.1


def map_pixels(x: torch.Tensor, eps: float = LOGIT_LAPLACE_EPS) -> torch.Tensor:
    """[0, 1] -> [eps, 1 - eps]: logit(x) is unbounded at 0 and 1, and black/white pixels are common."""
    return (1 - 2 * eps) * x + eps


def unmap_pixels(x: torch.Tensor, eps: float = LOGIT_LAPLACE_EPS) -> torch.Tensor:
    """Inverse of :func:`map_pixels`, clamped to the valid image range."""
    return torch.clamp((x - eps) / (1 - 2 * eps), 0, 1)


def gumbel_softmax(logits: torch.Tensor, tau: float, dim: int = 1) -> torch.Tensor:
    """The relaxed sample ``softmax((logits + g) / tau)`` with Gumbel noise ``g = -log(-log(u))``, ``u ~ U(0, 1)``.

    The same distribution as ``F.gumbel_softmax(hard=False)``, drawn from uniforms: on CPU its ``exponential_``
    generator takes three times as long as ``rand`` and two in-place logs, a visible share of a small dVAE's step.
    ``u`` is kept above the smallest normal float so the noise stays finite."""
    u = torch.rand_like(logits).clamp_(min=torch.finfo(logits.dtype).tiny)
    noise = u.log_().neg_().log_().neg_()
    return ((logits + noise) / tau).softmax(dim)


def conv(n_in: int, n_out: int, kw: int) -> nn.Conv2d:
    """Same-padded conv with the paper's init: weights ~ N(0, 1 / (n_in * kw^2)), biases 0."""
    layer = nn.Conv2d(n_in, n_out, kw, padding=(kw - 1) // 2)
    nn.init.normal_(layer.weight, std=1 / math.sqrt(n_in * kw**2))
    nn.init.zeros_(layer.bias)
    return layer


class FP32Conv2d(nn.Conv2d):
    """A conv that stays out of autocast: the encoder logits and the K-way codebook input are kept in full
    precision (as ``use_float16=False`` in OpenAI's release and the paper's fp32 logits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.to(self.weight.dtype))


def fp32_conv(n_in: int, n_out: int, kw: int) -> FP32Conv2d:
    layer = FP32Conv2d(n_in, n_out, kw, padding=(kw - 1) // 2)
    nn.init.normal_(layer.weight, std=1 / math.sqrt(n_in * kw**2))
    nn.init.zeros_(layer.bias)
    return layer


class ResPath(nn.Sequential):
    """A block's residual branch (``res_path``, OpenAI's name): an ``nn.Sequential`` whose body is compiled as one
    region under ``compile_mode`` (:mod:`dalle_lightning.models.regions`); hooks on it (the precision plugin's
    boundaries, FSDP2's unit) stay outside the graph. Parameter names are those of the plain ``Sequential``."""

    def __init__(self, layers: OrderedDict[str, nn.Module], compile_mode: CompileMode = False) -> None:
        super().__init__(layers)
        self.compile_mode = check_compile(compile_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RES_PATH(self, x) if wants_compiled(self.compile_mode, x) else self._body(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


_RES_PATH = CompiledRegion(ResPath._body)


class EncoderBlock(nn.Module):
    """Bottleneck resblock: id_path(x) + post_gain * res_path(x), res_path relu-3x3-relu-3x3-relu-3x3-relu-1x1."""

    def __init__(self, n_in: int, n_out: int, n_layers: int, min_hidden: int = 0,
                 compile_mode: CompileMode = False) -> None:
        super().__init__()
        if n_out % 4 != 0:
            raise ValueError(f"n_out={n_out} is not divisible by 4; expected a width with a n_out/4 bottleneck")
        n_hid = max(n_out // 4, min_hidden)
        # 1 / n_layers^2 keeps the sum of residual branches near the identity at initialisation.
        self.post_gain = 1 / n_layers**2
        self.id_path = conv(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        self.res_path = ResPath(
            OrderedDict(
                relu_1=nn.ReLU(),
                conv_1=conv(n_in, n_hid, 3),
                relu_2=nn.ReLU(),
                conv_2=conv(n_hid, n_hid, 3),
                relu_3=nn.ReLU(),
                conv_3=conv(n_hid, n_hid, 3),
                relu_4=nn.ReLU(),
                conv_4=conv(n_hid, n_out, 1),
            ),
            compile_mode,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.id_path(x) + self.post_gain * self.res_path(x)


class DecoderBlock(nn.Module):
    """Bottleneck resblock: id_path(x) + post_gain * res_path(x), res_path relu-1x1-relu-3x3-relu-3x3-relu-3x3."""

    def __init__(self, n_in: int, n_out: int, n_layers: int, min_hidden: int = 0,
                 compile_mode: CompileMode = False) -> None:
        super().__init__()
        if n_out % 4 != 0:
            raise ValueError(f"n_out={n_out} is not divisible by 4; expected a width with a n_out/4 bottleneck")
        n_hid = max(n_out // 4, min_hidden)
        self.post_gain = 1 / n_layers**2
        self.id_path = conv(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        self.res_path = ResPath(
            OrderedDict(
                relu_1=nn.ReLU(),
                conv_1=conv(n_in, n_hid, 1),
                relu_2=nn.ReLU(),
                conv_2=conv(n_hid, n_hid, 3),
                relu_3=nn.ReLU(),
                conv_3=conv(n_hid, n_hid, 3),
                relu_4=nn.ReLU(),
                conv_4=conv(n_hid, n_out, 3),
            ),
            compile_mode,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.id_path(x) + self.post_gain * self.res_path(x)


def _check_config(group_count: int, n_hid: int, n_blk_per_group: int, vocab_size: int) -> None:
    for name, value in dict(
        group_count=group_count, n_hid=n_hid, n_blk_per_group=n_blk_per_group, vocab_size=vocab_size
    ).items():
        if value < 1:
            raise ValueError(f"{name}={value} is not positive; expected an integer >= 1")
    if n_hid % 4 != 0:
        raise ValueError(f"n_hid={n_hid} is not divisible by 4; expected a multiple of 4 (bottleneck width n/4)")


class Encoder(nn.Module):
    """Image (pixels mapped to [eps, 1-eps]) -> logits over the K codes, [B, K, H / 2^(g-1), W / 2^(g-1)]."""

    def __init__(
        self,
        group_count: int = 4,
        n_hid: int = 256,
        n_blk_per_group: int = 2,
        input_channels: int = 3,
        vocab_size: int = 8192,
        min_hidden: int = 0,
        compile_mode: CompileMode = False,
    ) -> None:
        super().__init__()
        _check_config(group_count, n_hid, n_blk_per_group, vocab_size)
        n_layers = group_count * n_blk_per_group
        widths = [n_hid * 2**g for g in range(group_count)]
        layers: OrderedDict[str, nn.Module] = OrderedDict(input=conv(input_channels, n_hid, 7))
        n_in = n_hid
        for g, width in enumerate(widths, start=1):
            group: OrderedDict[str, nn.Module] = OrderedDict()
            for i in range(1, n_blk_per_group + 1):
                group[f"block_{i}"] = EncoderBlock(n_in, width, n_layers, min_hidden, compile_mode)
                n_in = width
            if g < group_count:
                group["pool"] = nn.MaxPool2d(kernel_size=2)
            layers[f"group_{g}"] = nn.Sequential(group)
        layers["output"] = nn.Sequential(OrderedDict(relu=nn.ReLU(), conv=fp32_conv(n_in, vocab_size, 1)))
        self.blocks = nn.Sequential(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Decoder(nn.Module):
    """(Relaxed) one-hot codes [B, K, h, w] -> [B, 2C, h * 2^(g-1), w * 2^(g-1)]: mu then ln b per channel."""

    def __init__(
        self,
        group_count: int = 4,
        n_init: int = 128,
        n_hid: int = 256,
        n_blk_per_group: int = 2,
        output_channels: int = 3,
        vocab_size: int = 8192,
        min_hidden: int = 0,
        compile_mode: CompileMode = False,
    ) -> None:
        super().__init__()
        _check_config(group_count, n_hid, n_blk_per_group, vocab_size)
        self.vocab_size = vocab_size
        n_layers = group_count * n_blk_per_group
        widths = [n_hid * 2**g for g in reversed(range(group_count))]
        layers: OrderedDict[str, nn.Module] = OrderedDict(input=fp32_conv(vocab_size, n_init, 1))
        n_in = n_init
        for g, width in enumerate(widths, start=1):
            group: OrderedDict[str, nn.Module] = OrderedDict()
            for i in range(1, n_blk_per_group + 1):
                group[f"block_{i}"] = DecoderBlock(n_in, width, n_layers, min_hidden, compile_mode)
                n_in = width
            if g < group_count:
                group["upsample"] = nn.Upsample(scale_factor=2, mode="nearest")
            layers[f"group_{g}"] = nn.Sequential(group)
        layers["output"] = nn.Sequential(OrderedDict(relu=nn.ReLU(), conv=conv(n_in, 2 * output_channels, 1)))
        self.blocks = nn.Sequential(layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.blocks(z)

    def forward_indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Decode hard codes [B, h, w] without materialising the one-hot: a 1x1 conv of a one-hot is a lookup
        of the conv's weight columns (the codebook), which saves B * K * h * w floats at K = 8192."""
        if idx.dtype != torch.long or idx.dim() != 3:
            raise ValueError(f"indices of dtype {idx.dtype} and shape {tuple(idx.shape)}; expected LongTensor[B, h, w]")
        first: nn.Conv2d = self.blocks.input
        codebook = first.weight[:, :, 0, 0].t()  # [K, n_init]
        x = F.embedding(idx, codebook) + first.bias  # [B, h, w, n_init]
        x = x.permute(0, 3, 1, 2).contiguous()
        for name, module in self.blocks.named_children():
            if name != "input":
                x = module(x)
        return x


class DiscreteVAE(nn.Module):
    """Encoder + decoder + the relaxed ELB. Images are float [B, C, image_size, image_size] in [0, 1].

    ``compile``: compile each resblock's residual branch as a region (``True``, ``False`` or ``"auto"``: where the
    images are on CUDA); see :mod:`dalle_lightning.models.regions`."""

    relaxed = True  # trained through the Gumbel relaxation with a KL term: the temperature and KL schedules apply

    def __init__(
        self,
        image_size: int = 64,
        vocab_size: int = 8192,
        n_hid: int = 256,
        n_blk_per_group: int = 2,
        group_count: int = 4,
        codebook_dim: int = 128,
        channels: int = 3,
        eps: float = LOGIT_LAPLACE_EPS,
        codebook_init_std: float | None = None,
        block_min_hidden: int = 0,
        compile: CompileMode = False,  # noqa: A002 - the config key users set
    ) -> None:
        super().__init__()
        compile_mode = check_compile(compile)
        factor = 2 ** (group_count - 1)
        if image_size < 1 or image_size % factor != 0:
            raise ValueError(
                f"image_size={image_size} is not divisible by the downsampling factor {factor} "
                f"(2**(group_count-1), group_count={group_count}); expected a positive multiple of {factor}"
            )
        if int(block_min_hidden) != block_min_hidden or block_min_hidden < 0:
            raise ValueError(f"block_min_hidden={block_min_hidden}; expected 0 (the paper's width / 4) or a channel count")
        if not 0 < eps < 0.5:
            raise ValueError(f"eps={eps} is outside (0, 0.5); expected the logit-Laplace pixel margin (paper 0.1)")
        self.image_size = image_size
        self.vocab_size = vocab_size
        self.channels = channels
        self.eps = eps
        self.downsample_factor = factor
        self.encoder = Encoder(group_count, n_hid, n_blk_per_group, channels, vocab_size, block_min_hidden,
                               compile_mode)
        self.decoder = Decoder(group_count, codebook_dim, n_hid, n_blk_per_group, channels, vocab_size,
                               block_min_hidden, compile_mode)
        if codebook_init_std is not None:
            # The decoder's input conv is the codebook: with the paper's 1/sqrt(K) init its columns are so small
            # that the relaxed codes barely move the decoder, and a short run learns shapes but never colours
            # (on the shapes world: grey reconstructions at the paper's init, colours early with std 1).
            if codebook_init_std <= 0:
                raise ValueError(f"codebook_init_std={codebook_init_std}; expected a positive std or null (paper init)")
            nn.init.normal_(self.decoder.blocks.input.weight, std=codebook_init_std)

    @property
    def grid_size(self) -> int:
        """Side of the token grid: image_size / 2^(group_count - 1)."""
        return self.image_size // self.downsample_factor

    def resblocks(self) -> list[tuple[str, nn.Module]]:
        """The residual branches (``res_path``), for the sharding strategy and per-resblock precision."""
        return [(name, m) for name, m in self.named_modules() if name.endswith(".res_path")]

    def _check_images(self, images: torch.Tensor) -> None:
        expected = (self.channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images of shape {tuple(images.shape)}; expected [B, {', '.join(map(str, expected))}]")

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Logits of q(z|x), [B, K, h, w] in fp32, from images in [0, 1]."""
        self._check_images(images)
        return self.encoder(map_pixels(images, self.eps)).float()

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """The prior's image tokens: argmax of the encoder logits (no Gumbel noise), LongTensor[B, h, w]."""
        return self.encode(images).argmax(dim=1)

    def decode_stats(self, idx: torch.Tensor) -> torch.Tensor:
        """Decoder output [B, 2C, H, W] (mu, ln b) for hard codes [B, h, w]."""
        if idx.dim() != 3 or idx.shape[1:] != (self.grid_size, self.grid_size):
            raise ValueError(f"indices of shape {tuple(idx.shape)}; expected [B, {self.grid_size}, {self.grid_size}]")
        if idx.numel():
            lo, hi = torch.stack(idx.aminmax()).tolist()  # one host read for both bounds
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"indices in [{lo}, {hi}]; expected codes in [0, {self.vocab_size - 1}]")
        return self.decode_hard(idx).float()

    def decode_hard(self, idx: torch.Tensor) -> torch.Tensor:
        """Decoder output for checked hard codes: a lookup of the codebook conv's columns."""
        return self.decoder.forward_indices(idx)

    def stats_to_images(self, stats: torch.Tensor) -> torch.Tensor:
        """Mean image of the logit-Laplace: sigmoid(mu), un-mapped and clamped to [0, 1]."""
        return unmap_pixels(torch.sigmoid(stats[:, : self.channels].float()), self.eps)

    def decode_indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], [B, C, H, W], from hard codes [B, h, w]."""
        return self.stats_to_images(self.decode_stats(idx))

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        """What the prior's tokens can show: argmax codes -> decoder -> images in [0, 1]. The codes are the encoder's
        own argmax, in range by construction: no check, so no host read."""
        return self.stats_to_images(self.decode_hard(self.get_codebook_indices(images)).float())

    def logit_laplace_nll(self, stats: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Mean over pixel values of -log f(x'|mu, b), f = exp(-|logit x' - mu| / b) / (2 b x'(1 - x')).

        The log(x'(1-x')) term does not depend on the model; it is kept so the value is a true NLL of x'.
        """
        stats = stats.float()
        mu, log_b = stats[:, : self.channels], stats[:, self.channels :]
        x = map_pixels(images.float(), self.eps)
        nll = math.log(2.0) + log_b + torch.log(x * (1 - x)) + (torch.logit(x) - mu).abs() * torch.exp(-log_b)
        return nll.mean()

    def forward(self, images: torch.Tensor, temperature: float = 1.0, kl_weight: float = 0.0,
                hard: bool = False) -> dict[str, torch.Tensor]:
        """Relaxed negative ELB per pixel value: recon_loss + kl_weight * kl.

        ``hard=True`` decodes the argmax codes (what ``dalle-encode`` hands the prior) and passes the gradient
        through ``softmax(logits / temperature)`` (a straight-through estimator without noise): the decoder then
        learns from the codes it will be given, not from samples among the near-equivalent codes a diffuse
        q(z|x) spreads over.

        ``kl`` is KL(q(z|x) || uniform over K) summed over the h*w latents and divided by the C*H*W pixel
        values, the normalisation of ``recon_loss`` (the paper's 256*256*3), so beta is comparable across sizes.
        Returns loss, recon_loss, kl, plus ``logits`` [B, K, h, w], their argmax ``indices`` [B, h, w] and the relaxed
        reconstruction ``recon``.
        """
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} is not positive; expected a Gumbel-softmax tau > 0")
        logits = self.encode(images)
        if hard:
            soft = (logits / temperature).softmax(dim=1)
            z = F.one_hot(logits.argmax(dim=1), self.vocab_size).permute(0, 3, 1, 2).to(soft) - soft.detach() + soft
        else:  # the relaxed sample is used in the forward pass too, as in the paper
            z = gumbel_softmax(logits, tau=temperature, dim=1)
        stats = self.decoder(z).float()
        recon_loss = self.logit_laplace_nll(stats, images)
        log_q = F.log_softmax(logits, dim=1)
        kl_per_latent = (log_q.exp() * log_q).sum(dim=1) + math.log(self.vocab_size)  # [B, h, w]
        kl = kl_per_latent.sum(dim=(1, 2)).mean() / images[0].numel()
        loss = recon_loss + kl_weight * kl
        return dict(
            loss=loss,
            recon_loss=recon_loss,
            kl=kl,
            logits=logits,
            indices=logits.detach().argmax(dim=1),
            recon=self.stats_to_images(stats).detach(),
        )
