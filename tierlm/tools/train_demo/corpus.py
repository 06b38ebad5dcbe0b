"""The demo model's corpus: Python source files already on this machine, split into training and held-out.

Sources: the interpreter's standard library and its site-packages folders (`sysconfig`), every `*.py`
below them. A file's place in the corpus is a function of its path relative to its root (say
`json/decoder.py`), not of the machine: its split (held out when a hash of that path falls in the
first `heldout_permille` of 1000) and its order (files are taken by that hash, so a byte cap keeps a
spread of packages rather than the alphabet's first ones). Two machines with different Python versions
or packages therefore agree on which paths are held out, and `bench/demo_perplexity.py` can rebuild the
held-out set anywhere.

Kept out: files over `MAX_FILE_BYTES` or with very long lines (generated tables, data), files that are
not UTF-8, and any file whose exact content was already taken (vendored copies), so no held-out text is
also a training text.
Token streams: each file's tokens followed by `<|endoftext|>`, concatenated (uint16 ids).
"""

from __future__ import annotations

import hashlib
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_FILE_BYTES = 200_000
# files that are mostly data, not code: skip them when their lines are this long on average
MAX_MEAN_LINE_LENGTH = 120


def source_roots(stdlib_only: bool = False) -> list[Path]:
    """The standard library and (unless stdlib_only) the site-packages folders, each once (a root inside
    another is kept apart: its files are listed under it alone)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"]]
    if not stdlib_only:
        candidates += [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    roots: list[Path] = []
    for candidate in candidates:
        root = Path(candidate).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def path_key(relative: str) -> int:
    """A stable 64-bit hash of a path relative to its root: its split and its place in the order."""
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")


def is_heldout(relative: str, heldout_permille: int) -> bool:
    return path_key(relative) % 1000 < heldout_permille


@dataclass
class Corpus:
    """The chosen files' texts (in order), with their relative paths."""

    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    train_paths: list[str] = field(default_factory=list)
    heldout_paths: list[str] = field(default_factory=list)

    @property
    def train_bytes(self) -> int:
        return sum(len(text.encode()) for text in self.train)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(text.encode()) for text in self.heldout)


def _candidates(roots: list[Path]) -> list[tuple[int, str, Path]]:
    """(path key, relative path, file) of every `*.py` under the roots, a nested root's files under it alone."""
    found: dict[str, tuple[int, str, Path]] = {}
    for root in roots:
        nested = [other for other in roots if other != root and other.is_relative_to(root)]
        for path in root.rglob("*.py"):
            if any(path.is_relative_to(other) for other in nested) or not path.is_file():
                continue
            relative = path.relative_to(root).as_posix()
            found.setdefault(relative, (path_key(relative), relative, path))
    return sorted(found.values())


def _read(path: Path) -> str | None:
    """The file's text, or None for a file the corpus leaves out (too big, not UTF-8, mostly data)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.count("\n") + 1
    if not text.strip() or len(text) / lines > MAX_MEAN_LINE_LENGTH:
        return None
    return text


def collect_corpus(
    max_train_bytes: int, max_heldout_bytes: int, heldout_permille: int = 20, roots: list[Path] | None = None
) -> Corpus:
    """Training files up to `max_train_bytes` and held-out files up to `max_heldout_bytes`, in path-hash
    order (see the module docstring)."""
    if not 0 < heldout_permille < 1000:
        raise ValueError(f"heldout_permille must lie in 1..999, got {heldout_permille}")
    corpus = Corpus()
    seen: set[bytes] = set()
    train_size = heldout_size = 0
    for key, relative, path in _candidates(roots if roots is not None else source_roots()):
        held = key % 1000 < heldout_permille
        if (held and heldout_size >= max_heldout_bytes) or (not held and train_size >= max_train_bytes):
            if train_size >= max_train_bytes and heldout_size >= max_heldout_bytes:
                break
            continue
        text = _read(path)
        if text is None:
            continue
        digest = hashlib.sha256(text.encode()).digest()
        if digest in seen:
            continue
        seen.add(digest)
        size = len(text.encode())
        if held:
            corpus.heldout.append(text)
            corpus.heldout_paths.append(relative)
            heldout_size += size
        else:
            corpus.train.append(text)
            corpus.train_paths.append(relative)
            train_size += size
    if (max_train_bytes > 0 and not corpus.train) or not corpus.heldout:
        raise RuntimeError(f"too few Python sources under {[str(r) for r in (roots or source_roots())]}: "
                           f"{len(corpus.train)} training and {len(corpus.heldout)} held-out files")
    return corpus


def read_files(relative_paths: list[str], roots: list[Path]) -> tuple[list[str], list[str]]:
    """(texts, paths) of the listed files (paths relative to a root, e.g. a run's held-out files) that this
    machine has under the first root holding them, as the corpus reads them; missing ones are skipped."""
    texts, found = [], []
    for relative in relative_paths:
        path = next((root / relative for root in roots if (root / relative).is_file()), None)
        text = _read(path) if path is not None else None
        if text is not None:
            texts.append(text)
            found.append(relative)
    return texts, found


def token_stream(tokenizer, texts: list[str], separator: int, batch_files: int = 512) -> np.ndarray:
    """Every text's ids followed by `separator`, concatenated: uint16 [N] (the tokenizer encodes batches
    of files on all cores)."""
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError("token_stream stores uint16 ids: the vocabulary must be below 65536")
    parts = []
    for start in range(0, len(texts), batch_files):
        for encoding in tokenizer.encode_batch(texts[start : start + batch_files], add_special_tokens=False):
            parts.append(np.asarray(encoding.ids, dtype=np.uint16))
            parts.append(np.asarray([separator], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def iter_windows(stream: np.ndarray, length: int) -> Iterator[np.ndarray]:
    """Consecutive non-overlapping windows of `length` tokens (the evaluation's; the tail is dropped)."""
    for start in range(0, len(stream) - length + 1, length):
        yield stream[start : start + length]
