"""The README's "Train on your own WebDataset shards" commands, run as written on a download of real photographs.

The commands are read from the README itself (``readme_commands``), so README and test cannot drift: the fenced
code block(s) under that heading, its shell variables expanded (``P="paths.world=... paths.work_dir=..."``), each
``dalle-*`` line split as a shell splits it (``shlex``) and run in order as the installed console script, with the
README's example paths (those it gives ``paths.world`` and ``paths.work_dir``) replaced by the test's download
and a temporary work dir. Each command gets small-size overrides by command and stage/model (``small_overrides``):
tiny networks and a few updates. The paper's sizes the README passes (an ``image_size``, a ``text_len``) are replaced
by the test's, nothing is added for them: sizes a later stage reads from an earlier stage's artifact must reach it
by themselves.

The download (``tests/helpers/img2dataset_download.py``) is img2dataset's layout of ``skimage.data`` photographs in
every format a crawl brings (JPEG, greyscale, RGBA and LA PNG, WebP with and without alpha, CMYK, EXIF-turned),
with one JPEG cut in half and one sample without a caption; in train/ and val/ folders, or the shards directly in
one folder. Besides every command exiting 0, the checks are:

- no caption is cut silently: the token shards' caption ids are as long as the tokenizer makes the captions, or the
  encode step reports how many it cut; the prior takes every id the shards hold;
- the truncated JPEG and the uncaptioned sample are skipped, named by key, and counted once each (per sample, not
  per read: training passes more than twice over the data), and no other sample is skipped;
- every other sample reaches the token shards;
- the evaluation report exists and holds no shapes-world caption accuracy (meaningless on these pictures).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## Train on your own WebDataset shards"
CONF = ROOT / "conf"

# The paper's sizes, as the README's commands and the paper's configs give them, and the test's: a 64-px dVAE
# (8x8 codes: the shapes CLIP's input size) with 128 codes, and 32 caption tokens (the download's long captions
# take more, so some are cut, and that must be reported). A README value of such a key (any key ending in the name:
# data.image_size, model.text_len, image_size) is replaced where it is the paper's, and kept where it is not: a
# README whose stages disagree still fails here.
PAPER_TO_TEST = {"image_size": {"256": "64"}, "text_len": {"256": "32"}}
IMAGE_SIZE, GRID, DVAE_VOCAB, TEXT_LEN = 64, 8, 128, 32
TRAIN_BATCH = 16
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# Small-size overrides per command: (app, stage) for every model of the stage, then (app, stage, model) for a
# model= choice (None: the stage's default model). "{epochs2}" is a number of updates that passes over the data
# more than twice (skips must be counted per sample, not per read). The paper's dVAE and prior shrink together.
SMALL: dict[tuple[str | None, ...], list[str]] = {
    ("dalle-train", "tokenizer"): [],
    ("dalle-train", "dvae"): [*QUIET, "trainer.max_steps={epochs2}", f"data.batch_size={TRAIN_BATCH}",
                              "data.num_workers=0", "trainer.limit_val_batches=2", "callbacks.recon_grid.num_images=4"],
    ("dalle-train", "dvae", "dvae_paper"): [f"model.image_size={IMAGE_SIZE}", "model.n_hid=16", "model.n_blk_per_group=1",
                                            f"model.vocab_size={DVAE_VOCAB}", "model.codebook_dim=32"],
    ("dalle-train", "dvae", None): ["model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16"],
    ("dalle-train", "clip"): [*QUIET, "trainer.max_steps={epochs2}", f"data.batch_size={TRAIN_BATCH}",
                              "data.num_workers=0", "trainer.limit_val_batches=2"],
    ("dalle-train", "prior"): [*QUIET, "trainer.max_steps=6", f"data.batch_size={TRAIN_BATCH}", "data.num_workers=0",
                               "trainer.limit_val_batches=1", "model.n_layer=2", "model.n_head=2", "model.d_head=16",
                               "callbacks.fid.num_images=16", "callbacks.sample_grid.num_images=4"],
    # Its caption and code sizes come from the tokenizer's and the dVAE's files by themselves.
    ("dalle-train", "prior", "prior_paper"): [],
    ("dalle-encode",): ["batch_size=32"],
    ("dalle-generate",): ["num_candidates=2", "batch_size=8"],
    ("dalle-eval",): ["n_seen=4", "n_zeroshot=4", "n_val=16", "candidates=[1,2]", "batch_size=8"],
}
# The apps whose config is one flat file (conf/<name>.yaml): an override of a key it lacks is dropped (its
# own-data options are being written), every other app's overrides always go in (Hydra refuses a mistyped key).
FLAT_CONFIGS = {"dalle-encode": "encode", "dalle-generate": "generate", "dalle-eval": "eval"}
# Skip reasons as counted (data.skips.REASONS, spaces as underscores).
CORRUPT, UNCAPTIONED = "corrupt_image", "missing_caption"
# Shapes-world measures an evaluation of other pictures must not report (the detector knows only shapes).
SHAPES_MEASURES = ("accuracy", "any_of_n", "reference_renders", "waterfall", "zeroshot")
COMMAND_TIMEOUT_S = 300  # one command; pytest-timeout ends the whole test at 600 s


# ----------------------------------------------------------------------------------------------------- parsing


def section(text: str, heading: str = HEADING) -> str:
    """The README's text under ``heading``, up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        raise AssertionError(f"README.md has no heading {heading!r}")
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i]) and not _in_fence(lines, i)), len(lines))
    return "\n".join(lines[start + 1:end])


def _in_fence(lines: list[str], i: int) -> bool:
    return sum(line.lstrip().startswith("```") for line in lines[:i]) % 2 == 1


SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")  # info strings of the blocks a reader runs in a shell


def code_blocks(text: str) -> list[str]:
    """The fenced shell code blocks of ``text`` (no info string, or a shell's), in order."""
    blocks = re.findall(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```", text, flags=re.M | re.S)
    return [body for info, body in blocks if info.strip().lower() in SHELL_BLOCKS]


def logical_lines(block: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return block.replace("\\\n", " ").splitlines()


ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand_text(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise AssertionError(f"the README's own-data block uses ${name} without setting it")
        return env[name]

    return VARIABLE.sub(value, text)


@dataclass
class Command:
    """One ``dalle-*`` line of the README block: the app and its arguments as the shell passes them."""

    app: str
    args: list[str]
    line: str  # as the README writes it

    def value(self, key: str) -> str | None:
        """The last ``key=value`` (with or without a leading ``+``/``++``) of the arguments."""
        found = None
        for arg in self.args:
            if "=" in arg and arg.split("=", 1)[0].lstrip("+") == key:
                found = arg.split("=", 1)[1]
        return found

    @property
    def kind(self) -> tuple[str, ...]:
        """(app, stage) for dalle-train, (app,) for the others: what ``SMALL`` is keyed by."""
        return (self.app, self.value("stage") or "dvae") if self.app == "dalle-train" else (self.app,)


def parse_block(block: str) -> tuple[list[Command], dict[str, str]]:
    """The ``dalle-*`` commands of one shell block, variables expanded, and the variables it sets.

    A line of ``NAME=value`` words only (``export`` allowed) sets variables; a word that is a whole ``$NAME`` splits
    into the value's words, as an unquoted expansion does in the shell; other lines that do not start with
    ``dalle-`` are not ours (a download command, say) and are left out."""
    env: dict[str, str] = {}
    commands = []
    for line in logical_lines(block):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "export":
            words = words[1:]
        if words and all(ASSIGNMENT.match(w) for w in words):
            for w in words:
                name, value = w.split("=", 1)
                env[name] = _expand_text(value, env)
            continue
        args: list[str] = []
        for w in words:
            whole = VARIABLE.fullmatch(w)
            args.extend(_expand_text(w, env).split() if whole else [_expand_text(w, env)])
        if args[0].startswith("dalle-"):
            commands.append(Command(args[0], args[1:], line.strip()))
    return commands, env


def readme_commands(text: str | None = None) -> list[Command]:
    """Every ``dalle-*`` command of the own-data section's code blocks, in order."""
    commands: list[Command] = []
    for block in code_blocks(section(README.read_text() if text is None else text)):
        commands.extend(parse_block(block)[0])
    return commands


def example_paths(commands: list[Command]) -> dict[str, str]:
    """The README's example paths: what its commands give ``paths.world`` and ``paths.work_dir`` (first seen)."""
    found: dict[str, str] = {}
    for cmd in commands:
        for key in ("paths.world", "paths.work_dir"):
            value = cmd.value(key)
            if value is not None:
                found.setdefault(key, value)
    return found


def substitute(commands: list[Command], world: Path, work: Path) -> list[Command]:
    """The commands with the README's example paths replaced (longest first) by ``world`` and ``work``."""
    paths = example_paths(commands)
    assert set(paths) == {"paths.world", "paths.work_dir"}, f"the README's commands set {paths}; expected both"
    mapping = sorted(((paths["paths.world"], str(world)), (paths["paths.work_dir"], str(work))),
                     key=lambda pair: -len(pair[0]))
    out = []
    for cmd in commands:
        args = []
        for arg in cmd.args:
            for old, new in mapping:
                arg = re.sub(rf"(?<![\w./-]){re.escape(old)}(?![\w.-])", new, arg)
            args.append(arg)
        out.append(Command(cmd.app, args, cmd.line))
    return out


# ----------------------------------------------------------------------------------------------------- small sizes


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~") if "=" in arg else ""


def _flat_keys(app: str) -> set[str] | None:
    name = FLAT_CONFIGS.get(app)
    if name is None:
        return None
    return set((yaml.safe_load((CONF / f"{name}.yaml").read_text()) or {}).keys())


def small_overrides(cmd: Command, n_samples: int) -> tuple[list[str], list[str]]:
    """``cmd``'s arguments at the test's size, and the overrides dropped (keys its app's config lacks).

    The paper's sizes the README passes take the test's values in place (``PAPER_TO_TEST``); then the command
    kind's overrides of ``SMALL`` go in, each replacing the README's argument of the same key or appended."""
    epochs2 = 2 * math.ceil(n_samples / TRAIN_BATCH) + 1
    args = []
    for arg in cmd.args:
        name, _, value = arg.partition("=")
        test_values = PAPER_TO_TEST.get(_key(arg).rsplit(".", 1)[-1], {})
        args.append(f"{name}={test_values[value]}" if value in test_values else arg)
    extra = list(SMALL.get(cmd.kind, []))
    if cmd.app == "dalle-train":
        extra += SMALL.get((*cmd.kind, cmd.value("model")), [])
    keys, dropped = _flat_keys(cmd.app), []
    for override in extra:
        override = override.replace("{epochs2}", str(epochs2))
        key = _key(override)
        if keys is not None and key.split(".", 1)[0] not in keys:
            dropped.append(override)
            continue
        at = [i for i, a in enumerate(args) if _key(a) == key]
        if at:
            args[at[-1]] = override
        else:
            args.append(override)
    return args, dropped


# ----------------------------------------------------------------------------------------------------- running


def entry_points() -> dict[str, str]:
    """Console script name -> ``module:function``, from pyproject.toml."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def argv_of(app: str) -> list[str]:
    """The installed console script beside this interpreter, else the entry point called as the script calls it."""
    script = Path(sys.executable).parent / app
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    module, function = entry_points()[app].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function} as m; sys.argv[0] = {app!r}; "
                                  "sys.exit(m())"]


@dataclass
class Ran:
    """One command as run: what it printed (stdout and stderr together), its exit code and time."""

    cmd: Command
    args: list[str]
    dropped: list[str]
    returncode: int
    output: str
    stderr: str
    seconds: float
    metrics: list[Path] = field(default_factory=list)  # metrics.json files the run wrote (dalle-train)

    @property
    def shown(self) -> str:
        return " ".join([self.cmd.app, *map(shlex.quote, self.args)])

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def run_command(cmd: Command, args: list[str], dropped: list[str], work: Path, cwd: Path) -> Ran:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DALLE_DEBUG", None)
    before = set(work.glob("runs/**/metrics.json"))
    start = time.perf_counter()
    proc = subprocess.run([*argv_of(cmd.app), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    seconds = time.perf_counter() - start
    metrics = sorted(set(work.glob("runs/**/metrics.json")) - before)
    return Ran(cmd, args, dropped, proc.returncode, proc.stdout + proc.stderr, proc.stderr, seconds, metrics)


def run_readme(download: Any, work: Path, cwd: Path, stop_at_failure: bool = True,
               extra: dict[tuple[str, ...], list[str]] | None = None) -> list[Ran]:
    """Run the README's own-data commands in order on ``download`` with ``work`` as the work dir; each command's
    checks (``CHECKS``) follow it. ``extra``: more overrides by command kind (appended)."""
    commands = substitute(readme_commands(), download.root, work)
    ran: list[Ran] = []
    for cmd in commands:
        args, dropped = small_overrides(cmd, download.n_samples)
        args += (extra or {}).get(cmd.kind, [])
        result = run_command(cmd, args, dropped, work, cwd)
        ran.append(result)
        dropped_note = f" (dropped, not in its config: {' '.join(dropped)})" if dropped else ""
        print(f"[{result.seconds:6.1f} s] exit {result.returncode}: {result.shown}{dropped_note}", flush=True)
        if result.returncode != 0:
            if stop_at_failure:
                raise AssertionError(f"`{result.shown}` (README: `{cmd.line}`) exited with {result.returncode}:\n"
                                     f"{result.tail()}")
            continue
        if stop_at_failure:
            check = CHECKS.get(cmd.kind)
            if check is not None:
                check(result, download, work)
    return ran


# ----------------------------------------------------------------------------------------------------- checks


SKIP_LINE = re.compile(r"(?:(\w+): )?(?:data/)?skipped/([a-z0-9_]+)=(\d+)")
KEY = re.compile(r"(?<!\d)(\d{9})(?!\d)")
CUT_LINE = re.compile(r"truncat|longer than|\bcut\b", re.I)


def skip_counts(ran: Ran) -> dict[str, int]:
    """Skipped samples by reason over everything the command read: its metrics.json where it wrote one, else the
    ``[split: ]skipped/<reason>=N`` lines it printed (summed over splits)."""
    counts: dict[str, int] = {}
    for path in ran.metrics:
        for name, value in json.loads(path.read_text()).get("metrics", {}).items():
            if name.startswith("data/skipped/"):
                reason = name.removeprefix("data/skipped/")
                counts[reason] = counts.get(reason, 0) + int(value)
    if ran.metrics:
        return counts
    for line in ran.output.splitlines():
        for _split, reason, n in SKIP_LINE.findall(line):
            counts[reason] = counts.get(reason, 0) + int(n)
    return counts


def skipped_keys(ran: Ran) -> dict[str, int]:
    """Keys the command's skip warnings name -> how many lines name them."""
    named: dict[str, int] = {}
    for line in ran.output.splitlines():
        if "skipped" in line and "skipped/" not in line:
            for key in KEY.findall(line):
                named[key] = named.get(key, 0) + 1
    return named


def check_skips(ran: Ran, download: Any, expected: dict[str, tuple[str, int]]) -> None:
    """The command counted exactly ``expected`` (reason -> (the key it skips, count)), named each key in its skip
    warnings, and skipped nothing else."""
    counts = {r: n for r, n in skip_counts(ran).items() if n}
    want = {reason: n for reason, (_key, n) in expected.items() if n}
    assert counts == want, (f"`{ran.shown}` counted skips {counts}; expected {want} (the truncated JPEG "
                            f"{download.truncated_key} and the uncaptioned {download.uncaptioned_key} once each, "
                            f"per sample and not per read)\n{ran.tail()}")
    named = skipped_keys(ran)
    for reason, (key, n) in expected.items():
        if n:
            assert key in named, f"`{ran.shown}` skipped {reason} without naming {key}:\n{ran.tail()}"
    bad = {download.truncated_key, download.uncaptioned_key}
    assert set(named) <= bad, f"`{ran.shown}` skipped samples it should decode: {sorted(set(named) - bad)}"


def check_tokenizer(ran: Ran, download: Any, work: Path) -> None:
    assert (work / "tokenizer.json").is_file(), f"no tokenizer.json in {work}"
    # It reads the captions of the training split only. The uncaptioned sample is in the first shard: in train/
    # in the split layout, and in the one-folder layout in the training part unless the held-out validation slice
    # takes it.
    counts = {r: c for r, c in skip_counts(ran).items() if c}
    n = counts.get(UNCAPTIONED, 0) if download.layout == "flat" else 1
    assert n <= 1, f"the tokenizer counted the uncaptioned sample {n} times\n{ran.tail()}"
    check_skips(ran, download, {UNCAPTIONED: (download.uncaptioned_key, n)})


def check_images_read(ran: Ran, download: Any, work: Path) -> None:
    """dVAE and CLIP training read every split: each bad sample is counted once however often it is read."""
    check_skips(ran, download, {CORRUPT: (download.truncated_key, 1), UNCAPTIONED: (download.uncaptioned_key, 1)})


def token_samples(tokens: Path) -> list[dict[str, Any]]:
    import numpy as np

    out = []
    for shard in sorted(tokens.glob("*/*.tar")):
        with tarfile.open(shard) as tar:
            members: dict[str, dict[str, bytes]] = {}
            for m in tar.getmembers():
                if m.isfile():
                    key, ext = m.name.split(".", 1)
                    members.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for key, sample in members.items():
            out.append({"key": key, "split": shard.parent.name, "txt": sample["txt"].decode(),
                        "ids": np.load(io.BytesIO(sample["ids.npy"])),
                        "codes": np.load(io.BytesIO(sample["codes.npy"]))})
    return out


def check_encode(ran: Ran, download: Any, work: Path) -> None:
    from tokenizers import Tokenizer

    tokens = Path(ran.cmd.value("out_dir") or ran.cmd.value("paths.tokens") or work / "tokens")
    samples = token_samples(tokens)
    keys = {s["key"] for s in samples}
    assert keys == download.usable_keys, (f"token shards hold {len(keys)} samples; expected the {len(download.usable_keys)} "
                                          f"decodable captioned ones (missing: {sorted(download.usable_keys - keys)[:5]}, "
                                          f"extra: {sorted(keys - download.usable_keys)[:5]})")
    check_skips(ran, download, {CORRUPT: (download.truncated_key, 1), UNCAPTIONED: (download.uncaptioned_key, 1)})
    tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
    tokenizer.no_truncation()  # the whole caption's ids, whatever the file says about its own length
    tokenizer.no_padding()
    full = {s["key"]: len(tokenizer.encode(s["txt"]).ids) for s in samples}
    assert max(full.values()) > 20, "the download's long captions should take more than 20 tokens"
    cut = sorted(s["key"] for s in samples if len(s["ids"]) < full[s["key"]])
    assert all(len(s["ids"]) <= full[s["key"]] for s in samples), "token shards hold more ids than the captions make"
    # Some captions cut: the command must say how many, in all or per split ("train: 24 of 94 captions were
    # longer than text_len=32 ... and were cut").
    said = [int(m.group(1)) for line in ran.output.splitlines() if CUT_LINE.search(line)
            for m in [re.search(r"(\d+)(?: of \d+)? captions?\b", line)] if m]
    if cut:
        example = next(s for s in samples if s["key"] == cut[0])
        assert len(cut) in (sum(said), *said), (
            f"`{ran.shown}` cut {len(cut)} captions (e.g. {cut[0]}: {full[cut[0]]} tokens -> {len(example['ids'])} "
            f"ids) but reported {said or 'none'}:\n{ran.tail()}")


def check_prior(ran: Ran, download: Any, work: Path) -> None:
    from dalle_lightning.artifacts import read_file

    counts = {r: n for r, n in skip_counts(ran).items() if n}
    assert not counts, f"the prior skipped token samples {counts}:\n{ran.tail()}"
    blob = read_file(work / "prior.pt")
    text_len = blob["meta"].get("text_len") or blob["config"].get("text_len")
    longest = max(len(s["ids"]) for s in token_samples(work / "tokens"))
    assert text_len >= longest, (f"the prior has text_len={text_len} but the token shards hold captions of "
                                 f"{longest} ids: it cuts them silently")


def check_generate(ran: Ran, download: Any, work: Path) -> None:
    out = Path(ran.cmd.value("out_dir") or work / "samples")
    assert (out / "grid.png").is_file(), f"no grid.png in {out}:\n{ran.tail()}"


def _keys_of(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in [f"{prefix}{key}", *_keys_of(value, f"{prefix}{key}.")]]
    if isinstance(tree, list):
        return [k for i, value in enumerate(tree) for k in _keys_of(value, f"{prefix}{i}.")]
    return []


def check_eval(ran: Ran, download: Any, work: Path) -> None:
    out = Path(ran.cmd.value("out") or work / "eval.json")
    assert out.is_file(), f"`{ran.shown}` wrote no report at {out}:\n{ran.tail()}"
    report = json.loads(out.read_text())
    shapes = [k for k in _keys_of({k: v for k, v in report.items() if k != "config"})
              if any(m in k.rsplit(".", 1)[-1] for m in SHAPES_MEASURES)]
    assert not shapes, f"the report on own data has shapes-world measures: {shapes[:8]}"


CHECKS = {
    ("dalle-train", "tokenizer"): check_tokenizer,
    ("dalle-train", "dvae"): check_images_read,
    ("dalle-train", "clip"): check_images_read,
    ("dalle-train", "prior"): check_prior,
    ("dalle-encode",): check_encode,
    ("dalle-generate",): check_generate,
    ("dalle-eval",): check_eval,
}
PIPELINE = [("dalle-train", "tokenizer"), ("dalle-train", "dvae"), ("dalle-encode",), ("dalle-train", "clip"),
            ("dalle-train", "prior"), ("dalle-generate",), ("dalle-eval",)]


# ----------------------------------------------------------------------------------------------------- tests


def test_readme_block_is_the_whole_pipeline(tmp_path: Path) -> None:
    """The block parses: every command is a console script of pyproject.toml, each stage comes after what it reads
    (tokenizer and dVAE before encode, encode before the prior, every stage before generate and eval), and the
    example paths are the only paths (all replaced)."""
    commands = readme_commands()
    assert commands, f"no dalle-* command under {HEADING!r}"
    scripts = entry_points()
    unknown = [c.line for c in commands if c.app not in scripts]
    assert not unknown, f"README commands that are no console script: {unknown}"
    kinds = [c.kind for c in commands]
    missing = [k for k in PIPELINE if k not in kinds]
    assert not missing, f"the README's own-data block runs {kinds}; missing {missing}"
    at = {k: kinds.index(k) for k in PIPELINE}
    tokenizer, dvae, encode, clip, prior, generate, evaluate = PIPELINE
    reads = {dvae: [], encode: [tokenizer, dvae], clip: [dvae], prior: [encode, clip],  # the prior's FID uses CLIP
             generate: [prior, clip], evaluate: [prior, clip]}
    late = [(k, first) for k, firsts in reads.items() for first in firsts if at[first] > at[k]]
    assert not late, f"the README runs these before what they read: {late}"
    examples = set(example_paths(commands).values())
    world, work = tmp_path / "download", tmp_path / "work"
    for cmd in substitute(commands, world, work):
        text = " ".join(cmd.args)
        assert not any(old in text for old in examples), f"an example path was not replaced in {cmd.args}"
        assert cmd.value("paths.work_dir") == str(work), f"`{cmd.line}` writes outside paths.work_dir"


def test_parser_expands_variables_as_the_shell_does() -> None:
    block = ("# comment\nexport A=x B='y z'\nP=\"paths.world=/d/w paths.work_dir=/d/r\"\n"
             "dalle-train stage=dvae $P \\\n    'prompts=[a b]' \"k=${A}1\"   # trailing comment\nls $A\n")
    commands, env = parse_block(block)
    assert env == {"A": "x", "B": "y z", "P": "paths.world=/d/w paths.work_dir=/d/r"}
    assert [(c.app, c.args) for c in commands] == [
        ("dalle-train", ["stage=dvae", "paths.world=/d/w", "paths.work_dir=/d/r", "prompts=[a b]", "k=x1"])]
    moved = substitute(commands, Path("/t/dl"), Path("/t/work"))
    assert moved[0].args[1:3] == ["paths.world=/t/dl", "paths.work_dir=/t/work"]


def test_skip_checks_count_per_sample_and_want_names() -> None:
    """The skip checks are not vacuous: a bad sample counted per read, a skip without its key, or a good sample
    skipped fails them."""
    from types import SimpleNamespace

    download = SimpleNamespace(truncated_key="000000003", uncaptioned_key="000000004")
    cmd = Command("dalle-encode", [], "dalle-encode $P")
    warn = "[t][dalle_lightning.data.skips][WARNING] - skipped /d/train/00000.tar:{}: {} (1 skipped so far)"
    good = [warn.format("000000003", "corrupt image"), warn.format("000000004", "missing caption"),
            "[t][dalle_lightning.encode][INFO] - train: skipped/corrupt_image=1",
            "[t][dalle_lightning.encode][INFO] - train: skipped/missing_caption=1",
            "[t][dalle_lightning.encode][INFO] - val: converted/greyscale=5"]
    expected = {CORRUPT: ("000000003", 1), UNCAPTIONED: ("000000004", 1)}

    def ran(lines: list[str]) -> Ran:
        return Ran(cmd, [], [], 0, "\n".join(lines), "", 0.0)

    check_skips(ran(good), download, expected)
    per_read = [*good, "[t][dalle_lightning.encode][INFO] - val: skipped/corrupt_image=1"]
    unnamed = [line for line in good if "000000004" not in line]
    wrong = [*good, warn.format("000000017", "corrupt image")]
    for lines in (per_read, unnamed, wrong):
        with pytest.raises(AssertionError):
            check_skips(ran(lines), download, expected)


def _run_layout(layout: str, tmp_path: Path) -> None:
    from tests.helpers.img2dataset_download import build_download

    download = build_download(tmp_path / "download", layout=layout)
    work = tmp_path / "work"
    ran = run_readme(download, work, cwd=tmp_path)
    kinds = [r.cmd.kind for r in ran]
    assert ("dalle-eval",) in kinds, f"the README's own-data block has no dalle-eval command ({kinds})"


@pytest.mark.slow
def test_readme_own_data_commands_on_train_and_val_folders(tmp_path: Path) -> None:
    _run_layout("split", tmp_path)


@pytest.mark.slow
def test_readme_own_data_commands_on_one_folder_of_shards(tmp_path: Path) -> None:
    _run_layout("flat", tmp_path)
