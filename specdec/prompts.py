"""Prompt sets: the single place where prompts are read.

Every source is reduced to conversations (a tuple of ``(role, content)`` turns) and every
conversation to one or more :class:`Prompt` objects in OpenAI chat format that end with a
user turn. Sources:

* ``"sharegpt"`` / ``"humaneval"``: the embedded defaults from :mod:`specdec.assets`;
* ``"longctx"``: the embedded long-context set (:mod:`specdec.longctx`): long ShareGPT
  conversations and standard-library source files, each followed by a question, in buckets of
  about 1K, 2K, 4K and 8K tokens (ids ``longctx-<k>k-...``; :func:`specdec.longctx.longctx_bucket`).
  Its prompts are long by design, so the default ``max_prompt_chars="auto"`` applies no cap to
  it (an explicit cap still applies: a recipe that reads it sets ``max_prompt_chars: null``);
* ``*.json``: a ShareGPT-style list of ``{"id", "conversations": [{"from", "value"}]}``;
* ``*.jsonl`` / ``*.jsonl.gz`` / ``*.parquet``: rows with ``messages`` (OpenAI chat list),
  ``prompt`` (a string, one user turn) or ``conversations`` (ShareGPT list), optional ``id``;
* a directory written by ``datasets.Dataset.save_to_disk`` (its ``*.arrow`` files are read
  with pyarrow, so the ``datasets`` package is not needed).

Filtering happens in a fixed order so that every split sees the same decisions: length caps,
then de-duplication over the *whole* source, then the hash-based train/holdout split, then
``limit``.

One room over 400 lines on purpose: it is the single place where prompts are read, so every
source goes through the same filters in the same order (one rule, one home).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from specdec import assets, longctx

log = logging.getLogger(__name__)

SPLITS = ("all", "train", "holdout")
BUILTIN_SOURCES = ("sharegpt", "humaneval", "longctx")
DEFAULT_MAX_PROMPT_CHARS = 8000  # what max_prompt_chars="auto" means, except for the sources below
_UNCAPPED_SOURCES = ("longctx",)  # long by design: "auto" applies no cap

# Row fields that can carry a conversation, in order of preference.
_ROW_FIELDS = ("messages", "conversations", "prompt")
_ACCEPTED_SOURCES = (
    "'sharegpt', 'humaneval', 'longctx', or a path to a .json (ShareGPT list), .jsonl, .jsonl.gz or "
    ".parquet file, or a directory written by datasets' save_to_disk"
)
_EXPECTED_FIELDS = (
    "'messages' (OpenAI chat list), 'prompt' (string) or 'conversations' (ShareGPT list)"
)

_NO_FIELD = "without 'messages', 'prompt' or 'conversations'"  # skip reason

# ShareGPT dumps use a few assistant names besides "gpt"; OpenAI roles map to themselves.
_ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}

_HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{code}\n```"


@dataclass(frozen=True)
class Prompt:
    """One generation request: chat messages ending with a user turn."""

    id: str  # stable id (source id, or sha1 of content when the source has none)
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    reference: str | None = None  # the dataset's own assistant answer to the last turn


class _Conversation(NamedTuple):
    id: str | None
    turns: tuple[tuple[str, str], ...]  # (role, content), roles already normalised


@dataclass(frozen=True)
class _Parsed:
    conversations: tuple[_Conversation, ...]
    rows: int
    skipped: tuple[tuple[str, int], ...]  # (reason, count)


class _Skip(Exception):
    """A row that holds no usable conversation; the message is the reason counted."""


# ---------------------------------------------------------------------------- public API


def load_prompts(
    source: str,
    *,
    split: str = "all",
    holdout_fraction: float = 0.05,
    limit: int | None = None,
    skip: int = 0,
    multi_turn: bool = False,
    max_prompt_chars: int | None | Literal["auto"] = "auto",
    min_prompt_chars: int = 1,
    dedup: bool = True,
) -> list[Prompt]:
    """Read ``source`` into a list of prompts (see :func:`iter_prompts`); ``limit`` keeps the
    first N after filtering and dropping the first ``skip``, in source order."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    prompts = iter_prompts(
        source,
        split=split,
        holdout_fraction=holdout_fraction,
        multi_turn=multi_turn,
        max_prompt_chars=max_prompt_chars,
        min_prompt_chars=min_prompt_chars,
        dedup=dedup,
    )
    return list(itertools.islice(prompts, skip, None if limit is None else skip + limit))


def iter_prompts(
    source: str,
    *,
    split: str = "all",
    holdout_fraction: float = 0.05,
    multi_turn: bool = False,
    max_prompt_chars: int | None | Literal["auto"] = "auto",
    min_prompt_chars: int = 1,
    dedup: bool = True,
) -> Iterator[Prompt]:
    """Yield prompts from ``source`` in source order.

    ``multi_turn=False`` gives one prompt per conversation (leading system turns + first user
    turn); ``multi_turn=True`` gives one per user turn, with every earlier turn as context and
    ids ``"<id>:<k>"`` (k counts user turns from 0). Lengths are the summed characters of
    all message contents. The split hashes the *conversation* id, so all turns of one
    conversation land in the same split and holdout context never appears in train.

    ``max_prompt_chars="auto"``: :data:`DEFAULT_MAX_PROMPT_CHARS`, or no cap for ``"longctx"``.

    Arguments and the source are checked, and the source parsed, before this returns.
    """
    if max_prompt_chars == "auto":
        max_prompt_chars = None if source in _UNCAPPED_SOURCES else DEFAULT_MAX_PROMPT_CHARS
    _check_args(split, holdout_fraction, max_prompt_chars, min_prompt_chars)
    parsed = _load(source)
    return _generate(
        parsed.conversations,
        split=split,
        holdout_fraction=holdout_fraction,
        multi_turn=multi_turn,
        max_prompt_chars=max_prompt_chars,
        min_prompt_chars=min_prompt_chars,
        dedup=dedup,
    )


def prompt_text(p: Prompt) -> str:
    """The last user message of ``p``."""
    for message in reversed(p.messages):
        if message["role"] == "user":
            return message["content"]
    raise ValueError(f"prompt {p.id!r} has no user message")


def is_holdout(key: str, holdout_fraction: float) -> bool:
    """Whether ``key`` falls in the holdout split; depends only on the key's bytes, so it is
    the same on every machine and Python version (unlike ``hash()``)."""
    bucket = int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) / 2**32
    return bucket < holdout_fraction


# ---------------------------------------------------------------------------- generation


def _check_args(split: str, holdout_fraction: float, max_chars: int | None, min_chars: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}; got {split!r}")
    if not 0.0 <= holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1], got {holdout_fraction}")
    if min_chars < 0:
        raise ValueError(f"min_prompt_chars must be >= 0, got {min_chars}")
    if max_chars is not None and max_chars < min_chars:
        raise ValueError(f"max_prompt_chars ({max_chars}) is below min_prompt_chars ({min_chars})")


def _generate(
    conversations: Iterable[_Conversation],
    *,
    split: str,
    holdout_fraction: float,
    multi_turn: bool,
    max_prompt_chars: int | None,
    min_prompt_chars: int,
    dedup: bool,
) -> Iterator[Prompt]:
    seen: set[bytes] = set()
    for conv in conversations:
        base_id = conv.id if conv.id is not None else _content_id(conv.turns)
        wanted = split == "all" or is_holdout(base_id, holdout_fraction) == (split == "holdout")
        turns = conv.turns
        chars = list(itertools.accumulate((len(c) for _, c in turns), initial=0))
        turn_keys: list[bytes] = []  # hashed lazily: most turns never start a kept prompt
        user_turns = [i for i, (role, _) in enumerate(turns) if role == "user"]
        for k, end in enumerate(user_turns if multi_turn else user_turns[:1]):
            if not turns[end][1].strip():
                continue  # nothing was asked; the caps alone would let it through next to a system turn
            total = chars[end + 1]
            if total < min_prompt_chars or (max_prompt_chars is not None and total > max_prompt_chars):
                continue
            if dedup:
                # Every candidate is recorded, even ones outside the requested split, so the
                # same copy survives whichever split is asked for and none leaks across.
                turn_keys.extend(_turn_key(*turn) for turn in turns[len(turn_keys) : end + 1])
                key = hashlib.sha1(b"".join(turn_keys[: end + 1])).digest()
                if key in seen:
                    continue
                seen.add(key)
            if wanted:
                yield _make_prompt(f"{base_id}:{k}" if multi_turn else base_id, turns, end)


def _make_prompt(prompt_id: str, turns: tuple[tuple[str, str], ...], end: int) -> Prompt:
    messages = [{"role": role, "content": content} for role, content in turns[: end + 1]]
    following = turns[end + 1] if end + 1 < len(turns) else None
    reference = following[1] if following is not None and following[0] == "assistant" else None
    return Prompt(id=prompt_id, messages=messages, reference=reference)


def _normalise(text: str) -> str:
    """Stripped, with whitespace runs collapsed to one space."""
    return " ".join(text.split())


def _turn_key(role: str, content: str) -> bytes:
    return hashlib.sha1(f"{role}\x1f{_normalise(content)}".encode("utf-8")).digest()


def _content_id(turns: tuple[tuple[str, str], ...]) -> str:
    text = "\x1e".join(f"{role}\x1f{_normalise(content)}" for role, content in turns)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------- sources


def _resolve(source: str) -> tuple[str, Path]:
    """Map ``source`` to (reader kind, path)."""
    if source == "sharegpt":
        return "json", assets.sharegpt_json()
    if source == "humaneval":
        return "humaneval", assets.humaneval_jsonl()
    if source == "longctx":
        return "longctx", assets.sharegpt_json()  # plus the standard library, see specdec.longctx
    path = Path(source).expanduser()
    name = path.name.lower()
    if name.endswith(".json"):
        kind = "json"
    elif name.endswith((".jsonl", ".jsonl.gz")):
        kind = "jsonl"
    elif name.endswith(".parquet"):
        kind = "parquet"
    elif path.is_dir():
        return "arrow_dir", path
    else:
        raise ValueError(f"unknown prompt source {source!r}: expected {_ACCEPTED_SOURCES}")
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {source!r} does not exist")
    return kind, path


def _load(source: str) -> _Parsed:
    kind, path = _resolve(source)
    return _parse_cached(kind, str(path), _stamp(path))


def _stamp(path: Path) -> tuple:
    """Changes whenever the file (or a file of the directory) is rewritten."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)


@functools.lru_cache(maxsize=8)
def _parse_cached(kind: str, path: str, stamp: tuple) -> _Parsed:
    # ``stamp`` is only part of the cache key: a rewritten file gets a fresh parse.
    del stamp
    return _collect(_READERS[kind](Path(path)), path)


def _collect(rows: Iterable[Any], path: str) -> _Parsed:
    conversations: list[_Conversation] = []
    skipped: Counter[str] = Counter()
    n_rows = 0
    for n_rows, row in enumerate(rows, 1):
        try:
            conversations.append(_conversation(row))
        except _Skip as why:
            skipped[str(why)] += 1
    if not conversations:
        if not n_rows:
            raise ValueError(f"prompt source {path} contains no rows")
        raise ValueError(
            f"no usable rows in {path}: expected each row to have {_EXPECTED_FIELDS} holding a "
            f"conversation that starts with a user turn; skipped {n_rows}: {_describe(skipped)}"
        )
    if skipped:
        # Missing fields suggest a wrong file or column name; odd shapes are normal in ShareGPT.
        level = logging.WARNING if skipped[_NO_FIELD] else logging.INFO
        log.log(level, "%s: skipped %d of %d rows (%s)", path, skipped.total(), n_rows, _describe(skipped))
    return _Parsed(tuple(conversations), n_rows, tuple(sorted(skipped.items())))


def _describe(skipped: Counter[str]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in skipped.most_common())


def _conversation(row: Any) -> _Conversation:
    """Normalise one row to a conversation, or raise :class:`_Skip`."""
    if not isinstance(row, dict):
        raise _Skip(_NO_FIELD)
    field = next((f for f in _ROW_FIELDS if row.get(f) is not None), None)
    if field is None:
        raise _Skip(_NO_FIELD)
    value = row[field]
    turns = (("user", value),) if isinstance(value, str) else _turns(value)
    if not turns:
        raise _Skip("with an empty conversation")
    first = next((role for role, _ in turns if role != "system"), None)
    if first != "user":
        raise _Skip("not starting with a user turn")
    row_id = row.get("id")
    return _Conversation(None if row_id is None else str(row_id), turns)


def _turns(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise _Skip("with a conversation that is not a list")
    turns = []
    for turn in value:
        if not isinstance(turn, dict):
            raise _Skip("with a turn that is not an object")
        # OpenAI ("role"/"content") and ShareGPT ("from"/"value") spellings.
        raw_role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = _ROLE_ALIASES.get(str(raw_role).lower())
        if role is None:
            raise _Skip("with an unknown role")
        if not isinstance(content, str):
            raise _Skip("with non-text content")
        turns.append((role, content))
    return tuple(turns)


# ---------------------------------------------------------------------------- readers


def _read_json_list(path: Path) -> list[Any]:
    """A JSON list; a list cut off mid-way (as the packaged ShareGPT file is) yields its
    complete leading elements."""
    text = path.read_text(encoding="utf-8")
    body = text.strip()
    if not body.startswith("["):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    if body.endswith("]"):
        return json.loads(text)  # a complete document parses strictly, errors and all
    return _salvage_json_list(text, path)


def _salvage_json_list(text: str, path: Path) -> list[Any]:
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    items: list[Any] = []
    pos = text.index("[") + 1
    while True:
        pos = separator.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the element cut off by the truncation
        items.append(item)
    log.warning(
        "%s ends mid-list after %d characters; using its %d complete elements", path, len(text), len(items)
    )
    return items


def _read_jsonl(path: Path) -> Iterator[Any]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None


def _read_humaneval(path: Path) -> Iterator[dict]:
    for row in _read_jsonl(path):
        code = _HUMANEVAL_TEMPLATE.format(code=row["prompt"].rstrip())
        yield {"id": row["task_id"], "messages": [{"role": "user", "content": code}]}


def _useful_columns(names: Iterable[str]) -> list[str]:
    # Converting only these keeps unrelated large columns (e.g. token ids) out of Python.
    return [c for c in ("id", *_ROW_FIELDS) if c in set(names)]


def _table_rows(table: pa.Table) -> list[dict]:
    columns = _useful_columns(table.column_names)
    if not columns:
        return [{} for _ in range(table.num_rows)]  # every row then counts as field-less
    return table.select(columns).to_pylist()


def _read_parquet(path: Path) -> Iterator[dict]:
    parquet = pq.ParquetFile(path)
    columns = _useful_columns(parquet.schema_arrow.names)
    if not columns:
        yield from ({} for _ in range(parquet.metadata.num_rows))
        return
    for batch in parquet.iter_batches(columns=columns):
        yield from batch.to_pylist()


def _arrow_files(directory: Path) -> list[Path]:
    """The data files of a ``save_to_disk`` directory, in dataset order."""
    if (directory / "dataset_dict.json").exists():
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise ValueError(f"{directory} holds a DatasetDict; point at one of its splits: {splits}")
    names: list[str] = []
    state = directory / "state.json"
    if state.exists():
        names = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not names:
        names = sorted(p.name for p in directory.glob("*.arrow"))
    if not names:
        raise ValueError(
            f"{directory} is not a prompt source: no *.arrow files (expected a directory "
            f"written by datasets' save_to_disk)"
        )
    return [directory / name for name in names]


def _read_arrow_rows(path: Path) -> list[dict]:
    # Rows are converted while the memory map is open: the table's buffers point into it.
    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()  # what save_to_disk writes
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_file(source).read_all()  # the IPC file format, also accepted
        return _table_rows(table)


def _read_arrow_dir(directory: Path) -> Iterator[dict]:
    for path in _arrow_files(directory):
        yield from _read_arrow_rows(path)


def _read_longctx(sharegpt: Path) -> list[dict]:
    # The ShareGPT parse is the cached one that source "sharegpt" uses (one read of 125 MB).
    parsed = _parse_cached("json", str(sharegpt), _stamp(sharegpt))
    return longctx.build_rows((c.id, c.turns) for c in parsed.conversations)


_READERS = {
    "json": _read_json_list,
    "longctx": _read_longctx,
    "humaneval": _read_humaneval,
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "arrow_dir": _read_arrow_dir,
}
