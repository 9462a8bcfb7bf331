"""Caption tokenizer: lower-cased byte-level BPE trained with Hugging Face ``tokenizers``.

The paper uses a lower-cased BPE vocabulary of 16,384 and at most 256 caption tokens, with 10% BPE dropout
while training. Id 0 is reserved for padding because the prior replaces it, position by position, with its
own learned padding tokens; id 1 is the unknown token.

The caption length ``text_len`` is a fact of the tokenizer, fixed when it is trained: ``tokenizer.json`` records it
as the format's own fixed-length padding (``padding.length``), so ``dalle-encode`` and the prior read it from the
file (``${meta:tokenizer.json,text_len}``) instead of a second setting that can disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

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
    """The ``tokenizers.Tokenizer`` of the file ``path``, its size checked first (:func:`checked_tokenizer_file`)."""
    return Tokenizer.from_file(str(checked_tokenizer_file(path)))


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
        if not isinstance(text_len, int) or isinstance(text_len, bool) or text_len <= 0:
            raise ValueError(f"text_len={text_len} must be a positive number of caption tokens")
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
