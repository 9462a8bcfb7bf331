"""``dalle-generate``: draw images for prompts (command line or file), rerank, write PNGs and a grid.

``rerank=clip|prior|both`` picks the kept candidate by the contrastive score, the prior's own score or both
(``dalle_lightning.generation.selection``).

With ``prime_image=PATH prime_rows=K`` every image starts from the top K token rows of that image and the prior
completes the rest under each prompt (the paper's image-to-image translation, see ``dalle_lightning.generation.priming``).
``out_dir`` is new, empty, or an earlier run's output: the earlier run's files are removed before the new ones are
written (and listed in the folder's marker), never anything else (``outputs.clear_samples``).

``dtype`` is the prior's compute dtype while sampling: its weights are cast once into a copy in that dtype, and
every step reads that copy without autocast, as gpt-fast samples (``dalle_lightning.generation.cast``). ``auto`` is
bf16 on a GPU that computes it natively, fp32 elsewhere (``hardware.auto_sampling_dtype``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from dalle_lightning import inside
from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, hydra_app
from dalle_lightning.hardware import AUTO, auto_sampling_dtype, resolve_device
from dalle_lightning.outputs import claim, clear_samples, write_marker

if TYPE_CHECKING:
    import torch

    from dalle_lightning.generation.generate import Generation, Generator

log = logging.getLogger("dalle_lightning.generation.generate")

KEYS = {"paths", "prompts", "prompts_file", "prior", "dvae", "tokenizer", "clip", "num_candidates", "batch_size",
        "temperature", "top_k", "top_p", "cond_scale", "seed", "out_dir", "save_candidates", "device", "prime_image",
        "prime_rows", "rerank", "verbose", "graphs", "dtype"}
DTYPES = ("auto", "fp32", "bf16", "fp16")  # the prior's compute dtype for sampling (generation/cast.py)


def read_prompts(cfg: DictConfig) -> list[str]:
    if cfg.prompts_file:
        path = Path(cfg.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts_file {str(path)!r} does not exist; expected a text file, one prompt per line")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompts_file {str(path)!r} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                             "expected a UTF-8 text file, one prompt per line") from None
        return [line.strip() for line in text.splitlines() if line.strip()]
    prompts = cfg.prompts
    return [prompts] if isinstance(prompts, str) else list(prompts)


def prime(cfg: DictConfig, gen: Generator, n_prompts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The prime image as the dVAE sees it and its top rows' tokens, one row per prompt (None: no priming)."""
    from dalle_lightning.generation.priming import check_prime_rows, load_prime_image, prime_tokens

    if cfg.prime_image is None:
        return None
    grid = gen.dvae.grid_size
    rows = check_prime_rows(grid // 2 if cfg.prime_rows is None else cfg.prime_rows, grid)
    image = load_prime_image(cfg.prime_image, gen.dvae.image_size)
    return image[0], prime_tokens(gen.dvae, image, rows).cpu().expand(n_prompts, -1)


def run(cfg: DictConfig) -> Generation:
    """Generate, write ``i.png`` per prompt, ``grid.png`` (and ``prime.png`` when priming); return the result."""
    from dalle_lightning.generation.generate import Generator, check_prompts
    from dalle_lightning.evaluation.grid import captioned_grid, save_image

    check_keys(cfg, KEYS)
    prompts = check_prompts(read_prompts(cfg))  # fail on an empty prompt before loading any model
    if cfg.prime_image is None and cfg.prime_rows is not None:
        raise ValueError(f"prime_rows={cfg.prime_rows} without prime_image; expected prime_image=PATH too")
    checks.integer(cfg, "num_candidates", minimum=1)
    checks.sampling(cfg)
    checks.choice(cfg, "dtype", DTYPES)
    checks.boolean(cfg, "save_candidates")
    checks.output_dir(cfg, "out_dir")
    out = Path(cfg.out_dir)
    inside.check(out / "candidates", out, "out_dir")  # written into and cleared: never a link out of out_dir
    claim(out, "samples")  # a folder of other files fails before any model loads
    device = resolve_device(cfg.device)
    dtype = auto_sampling_dtype(device) if cfg.dtype == AUTO else cfg.dtype
    if cfg.dtype == AUTO:
        log.info("dtype=auto: %s on %s", dtype, device)
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=device, dtype=dtype)
    primed = prime(cfg, gen, len(prompts))
    result = gen.generate(prompts, num_candidates=cfg.num_candidates, batch_size=cfg.batch_size,
                          temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, cond_scale=cfg.cond_scale,
                          seed=cfg.seed, image_prefix=None if primed is None else primed[1], progress=True,
                          rerank=cfg.rerank, graphs=cfg.graphs)
    clear_samples(out)
    files = []
    if primed is not None:
        save_image(primed[0], out / "prime.png")
        files.append("prime.png")
    for i, image in enumerate(result.images):
        files.append(f"{i}.png")
        save_image(image, out / files[-1])
        if cfg.save_candidates:
            for j, cand in enumerate(result.candidates[i]):
                files.append(f"candidates/{i}_{j}.png")
                save_image(cand, out / files[-1])
    grid = captioned_grid(result.images, result.prompts, out / "grid.png")
    write_marker(out, "samples", files=[*files, "grid.png"], prompts=result.prompts)
    print(f"grid: {grid}")
    log.info("wrote %d images and %s", len(prompts), grid)
    return result


@hydra_app("generate")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
