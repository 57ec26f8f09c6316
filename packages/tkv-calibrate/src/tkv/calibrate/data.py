"""Texts shipped with tkv.calibrate and their tokenization into fixed-length windows.

Package data (see ``data/README.md`` for provenance and licences):

* ``data/wikitext-2/valid.txt`` — calibration split (WikiText-2 validation, Merity et al. 2016);
* ``data/wikitext-2/test.txt`` — evaluation split (never used for calibration);
* ``data/haystack/*.txt`` — Paul Graham essays, the haystack of the needle test.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .errors import TextEncodingError, TextTooShortError

__all__ = [
    "TextWindows",
    "default_calib_text",
    "default_eval_text",
    "haystack_dir",
    "read_text",
    "tokenize_windows",
]


def _data_path(*parts: str) -> Path:
    return Path(str(resources.files("tkv.calibrate").joinpath("data", *parts)))


def default_calib_text() -> Path:
    """Path of the shipped WikiText-2 validation split (calibration text)."""
    return _data_path("wikitext-2", "valid.txt")


def default_eval_text() -> Path:
    """Path of the shipped WikiText-2 test split (evaluation text)."""
    return _data_path("wikitext-2", "test.txt")


def haystack_dir() -> Path:
    """Folder of the shipped haystack essays (``*.txt``)."""
    return _data_path("haystack")


def read_text(path: str | Path) -> tuple[str, str]:
    """Read a UTF-8 text file; returns ``(text, sha256 hex of its bytes)``.

    Raises:
        FileNotFoundError: no such file. TextEncodingError: not UTF-8.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file not found: {p}")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextEncodingError(f"text file {str(p)!r} is not UTF-8 (byte {e.start}: "
                                f"{e.reason})") from None
    return text, hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class TextWindows:
    """Token windows cut from one text.

    Attributes:
        ids: int64 ``(num_windows, window)`` token ids, consecutive non-overlapping windows
            from the start of the text (window ``i`` covers tokens ``[i*window, (i+1)*window)``).
        source: file path. sha256: digest of the file bytes. total_tokens: tokens in the text.
    """

    ids: torch.Tensor
    source: str
    sha256: str
    total_tokens: int

    @property
    def num_windows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def window(self) -> int:
        return int(self.ids.shape[1])

    def subset(self, start: int, count: int) -> torch.Tensor:
        """Windows ``start .. start+count-1`` as ``(count, window)`` (raises TextTooShortError)."""
        if start + count > self.num_windows:
            raise TextTooShortError(
                f"{self.source}: need windows {start}..{start + count - 1} of {self.window} tokens, "
                f"the text has only {self.num_windows} ({self.total_tokens} tokens)")
        return self.ids[start:start + count]


def tokenize_windows(tokenizer, path: str | Path, window: int, num_windows: int) -> TextWindows:
    """Tokenize ``path`` (no special tokens) and cut ``num_windows`` windows of ``window`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        window: tokens per window (> 1). num_windows: windows wanted (>= 1); the text may hold more.

    Raises:
        FileNotFoundError: missing file. TextTooShortError: fewer than ``window * num_windows`` tokens.
        ValueError: window < 2 or num_windows < 1.
    """
    if window < 2 or num_windows < 1:
        raise ValueError(f"need window >= 2 and num_windows >= 1, got {window}, {num_windows}")
    text, digest = read_text(path)
    # Tokenize in line chunks: fast and identical to whole-text tokenization at line breaks.
    ids: list[int] = []
    need = window * num_windows
    lines = text.splitlines(keepends=True)
    chunk = 200
    for i in range(0, len(lines), chunk):
        ids.extend(tokenizer("".join(lines[i:i + chunk]), add_special_tokens=False)["input_ids"])
        if len(ids) >= need + window:
            break
    total = len(ids)
    if total < need:
        raise TextTooShortError(
            f"{path}: {total} tokens, but {num_windows} windows of {window} tokens need {need}; "
            "pass a longer text or fewer/shorter windows")
    have = min(total // window, max(num_windows, total // window))
    t = torch.tensor(ids[: have * window], dtype=torch.long).view(have, window)
    return TextWindows(t, str(path), digest, total)
