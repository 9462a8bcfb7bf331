"""``dalle-generate``: draw images for prompts (command line or file), rerank, write PNGs and a grid.

``out_dir`` is new, empty, or an earlier run's output: the earlier run's files are removed before the new ones are
written (and listed in the folder's marker), never anything else (``outputs.clear_samples``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, hydra_app
from dalle_lightning.outputs import claim, clear_samples, write_marker

log = logging.getLogger("dalle_lightning.generate")

KEYS = {"paths", "prompts", "prompts_file", "prior", "dvae", "tokenizer", "clip", "num_candidates", "batch_size",
        "temperature", "top_k", "top_p", "cond_scale", "seed", "out_dir", "save_candidates", "device", "verbose"}


def read_prompts(cfg: DictConfig) -> list[str]:
    if cfg.prompts_file:
        path = Path(cfg.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts_file {str(path)!r} does not exist; expected a text file, one prompt per line")
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = cfg.prompts
    return [prompts] if isinstance(prompts, str) else list(prompts)


def run(cfg: DictConfig) -> Path:
    from dalle_lightning.generate import Generator, check_prompts
    from dalle_lightning.grid import captioned_grid, save_image

    check_keys(cfg, KEYS)
    prompts = check_prompts(read_prompts(cfg))  # fail on an empty prompt before loading any model
    checks.integer(cfg, "num_candidates", minimum=1)
    checks.sampling(cfg)
    checks.boolean(cfg, "save_candidates")
    checks.output_dir(cfg, "out_dir")
    out = Path(cfg.out_dir)
    claim(out, "samples")  # a folder of other files fails before any model loads
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)
    result = gen.generate(prompts, num_candidates=cfg.num_candidates, batch_size=cfg.batch_size,
                          temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, cond_scale=cfg.cond_scale,
                          seed=cfg.seed, progress=True)
    clear_samples(out)
    files = []
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
    return grid


@hydra_app("generate")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
