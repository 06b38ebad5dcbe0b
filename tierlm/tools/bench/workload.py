"""Prompt text for the benchmark: the warm lane, the cold lane and the state file behind it.

A server with a prefix cache answers a prompt it has seen before much faster than a new one, so a
benchmark has to say which of the two it measures:

- the warm lane sends one fixed text (per turn) in every request: the best case for a prefix cache;
- the cold lane gives every request text that no earlier request sent, in this invocation or any
  earlier one. The text comes either from a built-in generator (English-ish words drawn from a
  fixed list by a generator seeded with `--seed` and the prompt's index) or from the files of a
  corpus directory, read at offsets never used before. The next unused generator index (per seed)
  and the next unused offset (per corpus file) live in a small JSON state file. They are reserved,
  and the file written, before any request is sent, so even a crashed run never hands the same
  text to a later one.

Prompt lengths are measured with the model's tokenizer when `--tokenizer` is given, otherwise
approximated at 4 characters per token (`TokenCounter`).
"""

from __future__ import annotations

import fcntl
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from tierlm.cli import CliError

CHARS_PER_TOKEN = 4
DEFAULT_STATE_FILE = Path.home() / ".cache" / "tierlm" / "bench_state.json"

# Common English words; the generator strings them together. Enough of them that two prompts never
# share a long run of words by chance, short enough to read like (meaningless) prose.
WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were",
    "her", "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no",
    "will", "can", "more", "about", "said", "what", "out", "up", "them", "into", "than", "other", "could",
    "time", "only", "new", "some", "these", "two", "may", "first", "then", "do", "any", "like", "my", "now",
    "over", "such", "our", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before",
    "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because",
    "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world",
    "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old",
    "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three", "states",
    "himself", "few", "house", "use", "during", "without", "again", "place", "around", "however", "home",
    "small", "found", "thought", "went", "say", "part", "once", "general", "high", "upon", "school",
    "every", "does", "got", "united", "left", "number", "course", "war", "until", "always", "away",
    "something", "fact", "though", "water", "less", "public", "put", "think", "almost", "hand", "enough",
    "far", "took", "head", "yet", "government", "system", "better", "set", "told", "nothing", "night",
    "end", "why", "called", "eyes", "find", "going", "look", "asked", "later", "knew", "point", "next",
    "program", "city", "business", "give", "group", "toward", "young", "days", "let", "room", "president",
    "side", "social", "present", "given", "several", "order", "national", "possible", "rather", "second",
    "face", "per", "among", "form", "important", "often", "things", "looked", "early", "white", "case",
    "john", "become", "large", "big", "need", "four", "within", "felt", "along", "children", "saw", "best",
    "church", "ever", "least", "power", "development", "light", "thing", "seemed", "family", "interest",
    "want", "members", "mind", "country", "area", "others", "done", "turned", "although", "open", "problem",
    "river", "garden", "engine", "memory", "kernel", "tensor", "cache", "window", "signal", "bridge",
    "harbor", "forest",
]


class TokenCounter:
    """Counts tokens with the model's tokenizer if one is loaded, else approximates 4 chars/token."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str | None) -> TokenCounter:
        """Load a `tokenizer.json` (or a model directory holding one); no path: approximate."""
        if path is None:
            return cls()
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise CliError(f"--tokenizer: no tokenizer file at {file}")
        try:
            return cls(Tokenizer.from_file(str(file)))
        except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files
            raise CliError(f"--tokenizer: cannot load {file}: {exc}") from exc

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def prefix_end(self, text: str, num_tokens: int) -> int | None:
        """The character index where the first `num_tokens` tokens of `text` end; None if fewer."""
        if self.tokenizer is None:
            end = num_tokens * CHARS_PER_TOKEN
            return end if len(text) >= end else None
        offsets = self.tokenizer.encode(text, add_special_tokens=False).offsets
        return offsets[num_tokens - 1][1] if len(offsets) >= num_tokens else None


class PromptSource(Protocol):
    """Where prompt text comes from: reservable unseen pieces (cold) and a fixed text (warm)."""

    def reserve(self, state: dict, count: int) -> list: ...

    def text(self, ref) -> str: ...

    def warm_text(self, turn: int) -> str: ...


class GeneratedText:
    """Pseudo-random English-ish words; prompt `index` for a seed is always the same text.

    Each prompt starts with a header naming its seed and index, so two prompts differ from their
    first tokens on, and a prefix cache can reuse none of one for the other.
    """

    def __init__(self, seed: int, prompt_tokens: int, counter: TokenCounter):
        self.seed = seed
        self.prompt_tokens = prompt_tokens
        self.counter = counter

    def reserve(self, state: dict, count: int) -> list[int]:
        next_index = state.setdefault("generator", {})
        start = int(next_index.get(str(self.seed), 0))
        next_index[str(self.seed)] = start + count
        return list(range(start, start + count))

    def text(self, ref: int) -> str:
        return self._words(f"Session {self.seed}-{ref}:", rng_key=f"{self.seed}:{ref}")

    def warm_text(self, turn: int) -> str:
        return self._words(f"Session {self.seed}-warm-{turn}:", rng_key=f"{self.seed}:warm:{turn}")

    def _words(self, header: str, rng_key: str) -> str:
        rng = random.Random(rng_key)
        text = header
        while True:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(self.prompt_tokens))
            end = self.counter.prefix_end(text, self.prompt_tokens)
            if end is not None:
                return text[:end]


class CorpusText:
    """Consecutive pieces of the files under a directory (sorted by path), each about
    `prompt_tokens` long. The state file remembers, per file, the offset where unused text starts.
    A file's tail too short for a whole prompt is skipped.
    """

    def __init__(self, directory: str, prompt_tokens: int, counter: TokenCounter):
        root = Path(directory)
        if not root.is_dir():
            raise CliError(f"--corpus: {directory} is not a directory")
        self.files = sorted(p.resolve() for p in root.rglob("*") if p.is_file())
        if not self.files:
            raise CliError(f"--corpus: {directory} holds no files")
        self.directory = directory
        self.prompt_tokens = prompt_tokens
        self.counter = counter
        self._texts: dict[Path, str] = {}

    def reserve(self, state: dict, count: int) -> list[tuple[Path, int, int]]:
        next_offset = state.setdefault("corpus", {})
        pieces: list[tuple[Path, int, int]] = []
        for file in self.files:
            offset = int(next_offset.get(str(file), 0))
            while len(pieces) < count:
                end = self._piece_end(file, offset)
                if end is None:
                    offset = len(self._file_text(file))
                    break
                pieces.append((file, offset, end))
                offset = end
            next_offset[str(file)] = offset
            if len(pieces) == count:
                return pieces
        raise CliError(
            f"--corpus: {self.directory} has unused text for only {len(pieces)} of the {count} "
            f"prompts this run needs; add files or point --state-file elsewhere"
        )

    def text(self, ref: tuple[Path, int, int]) -> str:
        file, start, end = ref
        return self._file_text(file)[start:end]

    def warm_text(self, turn: int) -> str:
        """The turn-th piece from the very start of the corpus (the same in every invocation)."""
        file, offset = self.files[0], 0
        for _ in range(turn + 1):
            end = self._piece_end(file, offset)
            if end is None:
                raise CliError(f"--corpus: the first file of {self.directory} is too short for --turns")
            start, offset = offset, end
        return self._file_text(file)[start:offset]

    def _file_text(self, file: Path) -> str:
        if file not in self._texts:
            self._texts[file] = file.read_text(encoding="utf-8", errors="replace")
        return self._texts[file]

    def _piece_end(self, file: Path, start: int) -> int | None:
        text = self._file_text(file)
        window = self.prompt_tokens * 8 + 64
        while True:
            end = self.counter.prefix_end(text[start : start + window], self.prompt_tokens)
            if end is not None:
                return start + end
            if start + window >= len(text):
                return None
            window *= 2


class StateFile:
    """The JSON file of used cold-lane text, read and written under an exclusive lock so that two
    benchmarks started at once never reserve the same text."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()

    @contextmanager
    def update(self) -> Iterator[dict]:
        """Yield the state for changing; it is written back only if the block succeeds."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_path.touch()
        except OSError as exc:
            raise CliError(f"--state-file: cannot use {self.path}: {exc}") from exc
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._read()
            yield state
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
            temporary.replace(self.path)

    def _read(self) -> dict:
        if not self.path.exists():
            return {"version": 1}
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise CliError(f"--state-file: {self.path} is unreadable ({exc}); fix or move it") from exc
        if not isinstance(state, dict):
            raise CliError(f"--state-file: {self.path} does not hold a JSON object; fix or move it")
        return state


class PromptPlan:
    """The user messages of every run: `for_run(i)[conversation][turn]`.

    Cold text for all runs (warmup included) is reserved in the state file when the plan is made.
    """

    def __init__(
        self,
        source: PromptSource,
        lane: str,
        conversations: int,
        turns: int,
        total_runs: int,
        state_file: StateFile,
    ):
        self.source = source
        self.lane = lane
        self.conversations = conversations
        self.turns = turns
        self.cold_refs: list = []
        if lane == "cold":
            with state_file.update() as state:
                self.cold_refs = source.reserve(state, total_runs * conversations * turns)

    def for_run(self, run_index: int) -> list[list[str]]:
        if self.lane == "warm":
            fixed = [self.source.warm_text(turn) for turn in range(self.turns)]
            return [list(fixed) for _ in range(self.conversations)]
        first = run_index * self.conversations * self.turns
        return [
            [self.source.text(self.cold_refs[first + c * self.turns + t]) for t in range(self.turns)]
            for c in range(self.conversations)
        ]
