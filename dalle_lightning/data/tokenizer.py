"""Caption tokenizer: lower-cased byte-level BPE trained with Hugging Face ``tokenizers``.

The paper uses a lower-cased BPE vocabulary of 16,384 and at most 256 caption tokens, with 10% BPE dropout
while training. Id 0 is reserved for padding because the prior replaces it, position by position, with its
own learned padding tokens; id 1 is the unknown token.

The caption length ``text_len`` is a fact of the tokenizer, fixed when it is trained: ``tokenizer.json`` records it
as the format's own fixed-length padding (``padding.length``), so ``dalle-encode`` and the prior read it from the
file (``${meta:tokenizer.json,text_len}``) instead of a second setting that can disagree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from dalle_lightning_plugins.io.atomic_files import atomic_path

log = logging.getLogger(__name__)

PAD_ID = 0
UNK_ID = 1
SPECIAL_TOKENS = ["[PAD]", "[UNK]"]
# A tokenizer.json is read whole, and parsed into several times its size in memory. This project's (16,384 tokens)
# is about 1 MB and the largest published ones (262,144-token vocabularies) about 33 MB: a file beyond this bound
# is no tokenizer, and is refused before it is read rather than allowed to exhaust memory.
MAX_TOKENIZER_BYTES = 64 * 2**20
# The file bounds the file, not the work its pipeline asks for: a normalizer that doubles a letter forty times turns
# one letter into 2^40. So a tokenizer.json is read only with the components ``CaptionTokenizer.train`` writes, each
# with a bounded count, checked on its JSON before ``tokenizers`` builds anything (:func:`check_tokenizer_json`):
MAX_TEXT_LEN = 4096  # caption positions (padding.length, the recorded text_len): 16x the paper's 256; the prior's
#                      attention mask and text positions grow with it (squared), so 10**6 would ask for a terabyte
MAX_VOCAB = 2**18  # tokens: the largest published vocabularies (262,144), 4x a 64k-token BPE, 16x the paper's 16,384
MAX_ADDED_TOKENS = 1024  # this project adds 2 ([PAD], [UNK]); published tokenizers reserve a few hundred
MAX_NORMALIZERS = 4  # entries of the normalizer Sequence: this project writes NFKC then Lowercase
NORMALIZERS = ("NFKC", "Lowercase")  # neither grows a text more than a bounded factor, however often repeated
BYTE_LEVEL = "ByteLevel"  # the pre-tokenizer and decoder (the post-processor, if any) this project writes


def checked_tokenizer_file(path: str | Path) -> Path:
    """``path`` if it is a regular file of at most :data:`MAX_TOKENIZER_BYTES`; one line naming it otherwise, before
    anything of it is read (a device such as ``/dev/zero`` or a FIFO would never end)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist; train one with `dalle-train stage=tokenizer`")
    if not path.is_file():
        raise ValueError(f"tokenizer file {str(path)!r} is not a regular file; expected a tokenizer.json")
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer file {str(path)!r} holds {size} bytes, so it was not read; expected a "
                         f"tokenizer.json of at most {MAX_TOKENIZER_BYTES // 2**20} MiB (the largest published "
                         "tokenizers are about 33 MB)")
    return path


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of the file ``path``: its size checked first (:func:`checked_tokenizer_file`),
    then its components (:func:`check_tokenizer_json`), on the same bytes ``tokenizers`` then reads."""
    path = checked_tokenizer_file(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refusal(path, "the file", f"is not UTF-8 ({exc.reason} at byte {exc.start})", "JSON") from None
    check_tokenizer_json(text, path)
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"tokenizer file {str(path)!r} could not be read ({first}); expected a tokenizer.json "
                         "written by dalle-train stage=tokenizer") from None


def refusal(path: str | Path, component: str, found: str, expected: str) -> ValueError:
    """The one line refusing a ``tokenizer.json`` with a component this project does not write, or beyond a bound,
    naming the file and the component (a plain ``ValueError``: the commands print it as it is, exit code 2)."""
    return ValueError(f"tokenizer file {str(path)!r}: {component} {found}, so it was not read; expected {expected} "
                      "(a tokenizer.json written by dalle-train stage=tokenizer)")


class _Constant(Exception):
    """NaN or Infinity in the JSON (Python's parser takes them; strict JSON has none)."""


def _parse_json(text: str, path: str | Path) -> Any:
    def constant(name: str) -> None:
        raise _Constant(name)

    try:
        return json.loads(text, parse_constant=constant)
    except _Constant as exc:
        raise refusal(path, "the JSON", f"holds {exc}", "plain JSON") from None
    except RecursionError:
        raise refusal(path, "the JSON", "is nested too deeply to read", "plain JSON") from None
    except ValueError as exc:
        raise refusal(path, "the JSON", f"does not parse ({exc})", "plain JSON") from None


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _kind(component: Any) -> str:
    """A component's ``type``, as a file may write it (quoted for messages), or what stands there instead."""
    if component is None:
        return "null"
    return repr(component.get("type")) if isinstance(component, dict) else f"a {type(component).__name__}"


def check_tokenizer_json(text: str, path: str | Path) -> dict[str, Any]:
    """The parsed ``tokenizer.json`` ``text`` if it holds only the components :meth:`CaptionTokenizer.train` writes
    (a BPE model; NFKC and Lowercase normalizers; byte-level pre-tokenizer and decoder; fixed padding) within
    :data:`MAX_TEXT_LEN`, :data:`MAX_VOCAB`, :data:`MAX_ADDED_TOKENS` and :data:`MAX_NORMALIZERS`; a one-line
    ``ValueError`` (:func:`refusal`) naming ``path`` and the component otherwise. Checked before ``tokenizers``
    reads the file: some components cost without bound once built (a normalizer doubling a letter 40 times)."""
    record = _parse_json(text, path)
    if not isinstance(record, dict):
        raise refusal(path, "the file", f"holds {_kind(record)}", "a JSON object")
    known = {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor",
             "decoder", "model"}
    unknown = sorted(str(key) for key in record if key not in known)
    if unknown:
        raise refusal(path, "the file", f"has the keys {unknown}", f"only {sorted(known)}")
    if record.get("truncation") is not None:
        raise refusal(path, "truncation", "is set", "none (captions are cut and counted by dalle-lightning)")
    _check_padding(record.get("padding"), path)
    _check_normalizer(record.get("normalizer"), path)
    for key, optional in (("pre_tokenizer", False), ("decoder", True), ("post_processor", True)):
        component = record.get(key)
        if not (component is None and optional) and _kind(component) != repr(BYTE_LEVEL):
            raise refusal(path, key, f"is {_kind(component)}", f"{BYTE_LEVEL!r}" + (" or null" * optional))
    vocab = _check_model(record.get("model"), path)
    added = record.get("added_tokens") or []
    if not isinstance(added, list) or len(added) > MAX_ADDED_TOKENS:
        found = f"holds {len(added)} tokens" if isinstance(added, list) else f"is {_kind(added)}"
        raise refusal(path, "added_tokens", found, f"a list of at most {MAX_ADDED_TOKENS}")
    for token in added:
        if not isinstance(token, dict) or not _is_int(token.get("id"), 0, vocab + len(added) - 1) \
                or not isinstance(token.get("content"), str):
            raise refusal(path, "added_tokens", f"holds {str(token)[:80]!r}",
                                   f"tokens with a content and an id below {vocab + len(added)}")
    return record


def _check_padding(padding: Any, path: str | Path) -> None:
    """Fixed padding to at most :data:`MAX_TEXT_LEN` positions (the recorded ``text_len``), or none."""
    if padding is None:
        return
    strategy = padding.get("strategy") if isinstance(padding, dict) else None
    length = strategy.get("Fixed") if isinstance(strategy, dict) else None
    multiple = padding.get("pad_to_multiple_of") if isinstance(padding, dict) else None
    if not _is_int(length, 1, MAX_TEXT_LEN) or not (multiple is None or _is_int(multiple, 1, MAX_TEXT_LEN)):
        raise refusal(path, "padding.length (the recorded text_len)", f"is {str(strategy)[:80]}",
                               f"a fixed length of 1 to {MAX_TEXT_LEN} caption tokens (the paper's is 256)")


def _check_normalizer(normalizer: Any, path: str | Path) -> None:
    """NFKC and Lowercase, alone or in a Sequence of at most :data:`MAX_NORMALIZERS`, or none."""
    expected = f"null, or one of {list(NORMALIZERS)} or a Sequence of at most {MAX_NORMALIZERS} of them"
    steps = [normalizer] if normalizer is None or _kind(normalizer) != "'Sequence'" else normalizer.get("normalizers")
    if not isinstance(steps, list) or len(steps) > MAX_NORMALIZERS:
        found = f"is a Sequence of {len(steps)}" if isinstance(steps, list) else "is a Sequence without a list"
        raise refusal(path, "normalizer", found, expected)
    for step in steps:
        if step is not None and _kind(step) not in {repr(name) for name in NORMALIZERS}:
            raise refusal(path, "normalizer", f"holds {_kind(step)}", expected)


def _check_model(model: Any, path: str | Path) -> int:
    """A BPE model of at most :data:`MAX_VOCAB` tokens with ids 0 to n - 1, and at most as many merges of two
    tokens; returns its vocabulary's size."""
    if _kind(model) != "'BPE'":
        raise refusal(path, "model", f"is {_kind(model)}", "'BPE'")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or len(vocab) > MAX_VOCAB:
        found = f"holds {len(vocab)} tokens" if isinstance(vocab, dict) else f"is {_kind(vocab)}"
        raise refusal(path, "model.vocab", found, f"at most {MAX_VOCAB} tokens")
    ids = list(vocab.values())
    if not all(_is_int(i, 0, len(vocab) - 1) for i in ids) or len(set(ids)) != len(ids):
        raise refusal(path, "model.vocab", "has ids that are not 0 to its size - 1, each once",
                               f"the ids 0 to {len(vocab) - 1}")
    if not isinstance(merges, list) or len(merges) > MAX_VOCAB:
        found = f"holds {len(merges)} merges" if isinstance(merges, list) else f"is {_kind(merges)}"
        raise refusal(path, "model.merges", found, f"at most {MAX_VOCAB} merges")
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise refusal(path, "model.merges", f"holds {str(merge)[:80]!r}", "pairs of two tokens")
    dropout = model.get("dropout")
    if not (dropout is None or (isinstance(dropout, (int, float)) and not isinstance(dropout, bool)
                                and 0 <= dropout <= 1)):
        raise refusal(path, "model.dropout", f"is {dropout!r}", "null or a probability")
    return len(vocab)


class CaptionTokenizer:
    """Encodes captions to fixed-length id tensors (``text_len``), padding with ``PAD_ID``.

    Truncation is never silent: every truncated caption is counted (``truncated``, ``longest``) and the caller
    reports the count once (``truncation_line``), because a caption cut short trains the prior on a description
    that no longer matches its image. ``text_len=None`` takes the length the file records.
    """

    def __init__(self, tokenizer: Tokenizer, text_len: int | None = None) -> None:
        recorded = recorded_text_len(tokenizer)
        tokenizer.no_padding()  # ids come unpadded; encode_batch pads to text_len itself
        text_len = text_len if text_len is not None else recorded or 256
        if not _is_int(text_len, 1, MAX_TEXT_LEN):
            raise ValueError(f"text_len={text_len} must be a positive number of caption tokens, at most {MAX_TEXT_LEN} "
                             "(the paper's is 256)")
        if tokenizer.token_to_id("[PAD]") != PAD_ID:
            raise ValueError("tokenizer has no [PAD] token at id 0; expected one trained by CaptionTokenizer.train")
        self.tokenizer = tokenizer
        self.text_len = text_len
        self.recorded_text_len = recorded
        self.truncated = 0
        self.longest = 0  # tokens of the longest caption seen, cut or not

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 16_384, text_len: int = 256, min_frequency: int = 1) -> "CaptionTokenizer":
        """Train a lower-cased byte-level BPE on ``texts``; the vocabulary stops growing when merges run out."""
        if vocab_size < 260:
            raise ValueError(f"vocab_size={vocab_size} is too small; expected >= 260 (256 bytes + special tokens)")
        if vocab_size > MAX_VOCAB:
            raise ValueError(f"vocab_size={vocab_size} is too large; expected at most {MAX_VOCAB} "
                             "(the paper's is 16,384)")
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, text_len)

    @classmethod
    def load(cls, path: str | Path, text_len: int | None = None) -> "CaptionTokenizer":
        return cls(read_tokenizer(path), text_len)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (``dalle_lightning_plugins.io.atomic_files``), recording ``text_len``."""
        self.tokenizer.enable_padding(length=self.text_len, pad_id=PAD_ID, pad_token=SPECIAL_TOKENS[PAD_ID])
        try:
            with atomic_path(path) as tmp:
                self.tokenizer.save(str(tmp))
        finally:
            self.tokenizer.no_padding()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def set_dropout(self, p: float | None) -> None:
        """BPE dropout (paper: 0.1 while training the prior); ``None`` or 0 for deterministic encoding."""
        self.tokenizer.model.dropout = p if p else None

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, truncated to ``text_len`` (counted; ``truncation_line`` reports the count)."""
        ids = self.tokenizer.encode(text).ids
        self.longest = max(self.longest, len(ids))
        if len(ids) > self.text_len:
            self.truncated += 1
            log.debug("caption of %d tokens truncated to text_len=%d: %r", len(ids), self.text_len, text[:80])
            ids = ids[: self.text_len]
        return ids

    def truncation_line(self, what: str, total: int, cut: str = "were cut") -> str | None:
        """One line for the captions of ``what`` cut to ``text_len`` (None when none was), with the fix."""
        if not self.truncated:
            return None
        return (f"{what}: {self.truncated} of {total} captions were longer than text_len={self.text_len} tokens "
                f"(longest {self.longest}) and {cut}; to keep them whole, retrain the tokenizer with "
                f"model.text_len={self.longest} (dalle-train stage=tokenizer model.text_len={self.longest} stage.force=true)")

    def encode_batch(self, texts: Sequence[str]) -> torch.Tensor:
        """LongTensor[len(texts), text_len] padded with ``PAD_ID``."""
        out = torch.full((len(texts), self.text_len), PAD_ID, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = self.encode(text)
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode([i for i in ids if i != PAD_ID]).strip()


def recorded_text_len(tokenizer: Tokenizer) -> int | None:
    """The caption length a ``tokenizer.json`` records (its fixed padding length); None for older files."""
    padding = tokenizer.padding
    length = padding.get("length") if padding else None
    return int(length) if length else None
