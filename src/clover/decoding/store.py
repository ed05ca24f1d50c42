"""Drafts from earlier text: a store of token n-grams and the tokens that followed them.

A row's own context (prompt + answer, `NgramIndex`) drafts only what it already
contains. Much of what a model writes it has written before in other answers: the opening of
a code block, "Here is a", a signature's tail, a docstring's shape. `NgramStore` keeps, for
every 2-, 3- and 4-token n-gram of the text it was given, how often each next token followed
it; a draft follows the longest known suffix of the current text to the token that followed
it most often, while that token followed it in at least half of the cases, one token at a
time. Verification keeps only what the target itself writes, so whatever the store holds the
answers stay lossless; what it holds decides only how many drafts survive.

A model's runtime keeps one store (`Runtime.ngram_store`), fed with every finished
row's prompt and answer, so a server's later answers draft from its earlier ones; it can be
seeded with a `clover data distill` set of the same model or with text files
(`seed_store`). A server can keep what its answers taught across restarts: `save_learned`
writes the learned sequences (token ids, under a header naming the model) to a file that
`read_saved` reads back and that `seed_store` also takes as a seed. Retrieval drafting from a
datastore follows REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding"); ours is
an in-memory n-gram table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from clover.errors import CloverError
from clover.files import atomic_write
from clover.tokenizer import Tokenizer


class NgramIndex:
    """Where each 2- and 3-token n-gram of a token list last occurred (the position of the
    token that followed it), kept current as tokens are appended: a lookup is a dict read."""

    SIZES = (3, 2)  # longest first: a longer match is the better guess

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            j = len(self.tokens)  # t's position: it follows the n-grams ending at j - 1
            for n in self.SIZES:
                if j >= n:
                    self.after[tuple(self.tokens[j - n : j])] = j
            self.tokens.append(t)

    LONG = 32  # how far a long match may draft
    GROW_AFTER = 8  # a match of this many tokens is long (code and quotes repeat for a while)

    def draft(self, k: int, most: int | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the current suffix;
        up to min(LONG, most) when that occurrence matches the current text over GROW_AFTER
        tokens or more."""
        if k < 1:
            return []
        for n in self.SIZES:
            j = self.after.get(tuple(self.tokens[-n:])) if len(self.tokens) >= n else None
            if j is not None:
                if most is not None and self._match(j) >= self.GROW_AFTER:
                    k = max(k, min(self.LONG, most))
                return self.tokens[j : j + k]
        return []

    def follower(self, tail: list[int]) -> int | None:
        """The token that followed the latest occurrence, in the indexed tokens, of the longest
        suffix (3 or 2 tokens) of the indexed tokens + `tail` (a chain drafter's drafts so far):
        the copy a chain drafter's next draft leans to (`DrafterRunner.COPY_BONUS`)."""
        seq = self.tokens[-max(self.SIZES) :] + tail
        for n in self.SIZES:
            j = self.after.get(tuple(seq[-n:])) if len(seq) >= n else None
            if j is not None:
                return self.tokens[j]
        return None

    def _match(self, j: int) -> int:
        """How many tokens before position j equal the ones at the end (up to GROW_AFTER)."""
        m, end = 0, len(self.tokens)
        while (
            m < self.GROW_AFTER
            and j - 1 - m >= 0
            and self.tokens[j - 1 - m] == self.tokens[end - 1 - m]
        ):
            m += 1
        return m


class NgramStore:
    """n-gram -> {next token: count}, for n in ORDERS; drafts by majority, longest first."""

    ORDERS = (4, 3, 2)  # longest first: a longer match is the better guess

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        self.after: dict[tuple[int, ...], dict[int, int]] = {}
        self.tokens = 0  # tokens added so far
        self.max_tokens = max_tokens  # past this, `add` keeps nothing more (memory)
        self.sequences = 0
        self.learning = True  # finished rows feed the store (`learn`)
        self.learned: list[list[int]] = []  # what `learn` added, which `forget_learned` drops

    def add(self, tokens: list[int]) -> list[int]:
        """Count every n-gram of `tokens` with the token after it (as far as `max_tokens`
        leaves room); -> the tokens counted."""
        tokens = [int(t) for t in tokens[: max(0, self.max_tokens - self.tokens)]]
        self._count(tokens, 1)
        self.tokens += len(tokens)
        self.sequences += 1 if tokens else 0
        return tokens

    def learn(self, tokens: list[int]) -> None:
        """A finished row's prompt + answer, unless learning is off."""
        if self.learning:
            counted = self.add(tokens)
            if counted:
                self.learned.append(counted)

    def forget_learned(self) -> list[list[int]]:
        """Back to what was added with `add` alone; -> what `learn` had added (benchmarks run
        each setting from the same store: what one setting's answers taught must not help
        another's, `relearn` gives a setting back its own)."""
        for tokens in self.learned:
            self._count(tokens, -1)
            self.tokens -= len(tokens)
            self.sequences -= 1
        dropped, self.learned = self.learned, []
        return dropped

    def relearn(self, sequences: list[list[int]]) -> None:
        """Add `sequences` as learned (what `forget_learned` returned), learning on or off."""
        for tokens in sequences:
            counted = self.add(tokens)
            if counted:
                self.learned.append(counted)

    def _count(self, tokens: list[int], sign: int) -> None:
        for j in range(1, len(tokens)):
            nxt = tokens[j]
            for n in self.ORDERS:
                if j >= n:
                    key = tuple(tokens[j - n : j])
                    counts = self.after.setdefault(key, {})
                    c = counts.get(nxt, 0) + sign
                    if c > 0:
                        counts[nxt] = c
                    else:
                        counts.pop(nxt, None)
                        if not counts:
                            del self.after[key]

    def next_token(self, context: list[int]) -> int | None:
        """The token that most often followed the longest n-gram ending `context` that the
        store knows, if it did in at least half of that n-gram's occurrences."""
        for n in self.ORDERS:
            if len(context) < n:
                continue
            counts = self.after.get(tuple(context[-n:]))
            if counts:
                token, best = max(counts.items(), key=lambda kv: kv[1])
                return token if 2 * best >= sum(counts.values()) else None
        return None

    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens, each the store's guess after the context and the guesses before
        it; stops at the first position it has no majority guess for."""
        out: list[int] = []
        tail = list(context[-max(self.ORDERS) :])
        while len(out) < k:
            token = self.next_token(tail)
            if token is None:
                break
            out.append(token)
            tail = tail[1:] + [token]
        return out

    def describe(self) -> dict:
        """What a results file records: the seed's size and whether answers teach it."""
        seeded = self.tokens - sum(len(t) for t in self.learned)
        return {"seed_tokens": seeded, "seed_sequences": self.sequences - len(self.learned),
                "learning": self.learning}  # fmt: skip

    def __len__(self) -> int:
        return len(self.after)


def _distilled_sequences(directory: Path, model_name: str) -> Iterable[list[int]]:
    meta_path = directory / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CloverError(f"{directory}: not a `clover data distill` set ({e})") from None
    teacher = meta.get("teacher")
    if teacher != model_name:
        raise CloverError(
            f"{directory} was distilled from {teacher!r}, not {model_name!r}: its token ids "
            "belong to another tokenizer or model"
        )
    with open(directory / "distill.jsonl") as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                yield list(r["prompt_ids"]) + list(r["answer_ids"])


SAVED_FORMAT = "clover-ngram-store"  # the first line of a saved store: {"format": ..., ...}


def is_saved_store(path: str | Path) -> bool:
    """Whether `path` is a file `save_learned` wrote (its first line names the format)."""
    try:
        with open(path, "rb") as fh:
            head = fh.readline(4096)
        return json.loads(head).get("format") == SAVED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_learned(store: NgramStore, path: str | Path, model_name: str) -> int:
    """Write the sequences `store` learned from answers to `path` (a header line naming the
    model, then one JSON list of token ids a line), atomically: a crash mid-write leaves the
    last complete file. The file holds users' prompts and answers, so only its owner may read
    it (mode 0600). -> the sequences written."""
    path = Path(path)
    learned = list(store.learned)  # a snapshot: the decode thread may append meanwhile
    header = {"format": SAVED_FORMAT, "version": 1, "model": model_name,
              "sequences": len(learned), "tokens": sum(map(len, learned))}  # fmt: skip

    def write(tmp: Path) -> None:
        with open(tmp, "w") as fh:
            fh.write(json.dumps(header) + "\n")
            for tokens in learned:
                fh.write(json.dumps(tokens, separators=(",", ":")) + "\n")

    atomic_write(path, write, mode=0o600)
    return len(learned)


def read_saved(path: str | Path, model_name: str) -> list[list[int]]:
    """The sequences of a file `save_learned` wrote for `model_name`; anything else (another
    model's ids, another kind of file, a damaged line) is a clear error."""
    path = Path(path)
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"saved store {path}: cannot read it ({e})") from None
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != SAVED_FORMAT:
        raise CloverError(f"{path} is not a saved n-gram store (no {SAVED_FORMAT} header line)")
    if header.get("model") != model_name:
        raise CloverError(
            f"{path} was saved by {header.get('model')!r}, not {model_name!r}: its token ids "
            "belong to another tokenizer or model"
        )
    sequences = []
    for i, line in enumerate(lines[1:], start=2):
        try:
            tokens = json.loads(line)
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("not a list of token ids")
        except ValueError as e:
            raise CloverError(f"saved store {path}, line {i}: {e}") from None
        sequences.append(tokens)
    return sequences


def seed_store(
    store: NgramStore, paths: Iterable[str | Path], model_name: str, tokenizer: Tokenizer
) -> NgramStore:
    """Add to `store` (of the model `model_name`): `clover data distill` directories of this
    model (prompt + answer ids as written), stores a server saved (`save_learned`, of this
    model), and text files (encoded with `tokenizer`, no special tokens). Reads every path
    before adding any, so bad input adds nothing."""
    sources: list[tuple[str, Path]] = []
    for p in map(Path, paths):
        if p.is_dir():
            if not (p / "distill.jsonl").is_file():
                raise CloverError(f"{p}: a directory must be a `clover data distill` set")
            sources.append(("distill", p))
        elif p.is_file():
            sources.append(("text", p))
        else:
            raise CloverError(f"store seed {p}: no such file or directory")
    seqs: list[list[int]] = []
    for kind, p in sources:
        if kind == "distill":
            seqs += list(_distilled_sequences(p, model_name))
        elif is_saved_store(p):
            seqs += read_saved(p, model_name)
        else:
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CloverError(f"store seed {p}: cannot read it as UTF-8 text ({e})") from None
            seqs.append(list(tokenizer.encode(text, split_special_tokens=False)))
    for s in seqs:
        store.add(s)
    return store
