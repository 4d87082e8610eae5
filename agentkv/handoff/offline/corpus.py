"""Calibration corpora: text files (or a folder of them) cut into equal token sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".html", ".csv")


def corpus_files(path: str | Path) -> list[Path]:
    """The file itself, or every text-like file under a folder (sorted, so runs are reproducible)."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"no corpus at {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{root} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def token_stream(files: Iterable[Path], codec: Any) -> Iterable[int]:
    """Every file's token ids, one file after another (no special tokens)."""
    for path in files:
        yield from codec.encode(path.read_text(errors="replace"), add_special_tokens=False)


def token_sequences(path: str | Path, codec: Any, seq_len: int = 512, max_tokens: int = 131072) -> list[Any]:
    """Consecutive ``seq_len``-token windows of the corpus, up to ``max_tokens`` tokens: each [seq_len] int64."""
    import torch

    ids: list[int] = []
    for token in token_stream(corpus_files(path), codec):
        ids.append(int(token))
        if len(ids) >= max_tokens:
            break
    count = len(ids) // seq_len
    if count < 2:
        raise ValueError(f"the corpus gives {len(ids)} tokens: fewer than two sequences of {seq_len}")
    return list(torch.tensor(ids[: count * seq_len]).reshape(count, seq_len))
