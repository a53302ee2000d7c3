"""The documentation points at things that exist: README.md and docs/*.md.

* every relative link resolves to a file or directory of the repository (anchors and
  http(s)/mailto links are not checked);
* every `make <target>` named in their code (fenced blocks and inline code) is a target of
  the Makefile;
* every `python jobs/<name>.py` named there (also `python3`, `.venv/bin/python`,
  `ray job submit ... -- python jobs/...`) exists, and its `--help` exits 0;
* README.md, the front door, stays at most 200 lines.

A failure names the file, the line and what is broken.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
HELP_TIMEOUT_S = 240


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Snippet:
    """A piece of a document: prose (links live there) or code (commands live there)."""
    path: Path
    line: int  # 1-based line of the snippet's first character
    text: str

    def where(self, offset: int = 0) -> str:
        return f"{_rel(self.path)}:{self.line + self.text.count(chr(10), 0, offset)}"


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")


def split_doc(path: Path) -> tuple[list[Snippet], list[Snippet]]:
    """(prose, code) of a markdown file: fenced blocks are code; in the rest, inline code
    spans are code and are blanked out of the prose (newlines kept, so lines still count)."""
    prose, code = [], []
    lines = path.read_text(encoding="utf-8").splitlines()
    block: list[str] = []
    block_start = 0
    fence = None
    text_lines: list[str] = []
    text_start = 1

    def flush_text(end_line: int) -> None:
        nonlocal text_lines, text_start
        text = "\n".join(text_lines)
        for m in INLINE_CODE.finditer(text):
            line = text_start + text.count("\n", 0, m.start())
            code.append(Snippet(path, line, m.group(1).replace("\n", " ")))
        blanked = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        prose.append(Snippet(path, text_start, blanked))
        text_lines, text_start = [], end_line + 1

    for i, line in enumerate(lines, start=1):
        m = FENCE.match(line)
        if fence is None and m:
            flush_text(i)
            fence, block, block_start = m.group(1), [], i + 1
        elif fence is not None and m and m.group(1) == fence:
            code.append(Snippet(path, block_start, "\n".join(block)))
            fence, text_start = None, i + 1
        elif fence is not None:
            block.append(line)
        else:
            text_lines.append(line)
    if fence is not None:
        code.append(Snippet(path, block_start, "\n".join(block)))
    else:
        flush_text(len(lines))
    return prose, code


# ---------------------------------------------------------------------------- links

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REF_DEF = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def relative_links(snippet: Snippet):
    for pattern in (LINK, REF_DEF):
        for m in pattern.finditer(snippet.text):
            target = m.group(1)
            if SCHEME.match(target) or target.startswith("#"):
                continue  # http(s), mailto, ...; an anchor in the same page
            yield snippet.where(m.start()), target


def test_relative_links_resolve():
    broken = []
    for path in doc_files():
        prose, _ = split_doc(path)
        for snippet in prose:
            for where, target in relative_links(snippet):
                file_part = re.split(r"[#?]", target, maxsplit=1)[0]
                if not file_part:
                    continue
                resolved = (REPO / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
                if not resolved.exists():
                    broken.append(f"{where}: link '{target}' -> {os.path.relpath(resolved, REPO)} does not exist")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------- commands

def commands(snippet: Snippet):
    """(where, tokens) of each shell command in a code snippet: lines joined at a trailing
    backslash, split at ; && || |, comments dropped."""
    lines = snippet.text.split("\n")
    i = 0
    while i < len(lines):
        start, logical = i, lines[i]
        while logical.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            logical = logical.rstrip()[:-1] + " " + lines[i]
        i += 1
        try:
            lexer = shlex.shlex(logical, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:  # not shell (unbalanced quotes in a JSON example, ...)
            tokens = logical.split("#", 1)[0].split()
        current: list[str] = []
        for tok in tokens + [";"]:
            if tok and set(tok) <= set(";&|"):
                if current:
                    yield f"{_rel(snippet.path)}:{snippet.line + start}", current
                current = []
            else:
                current.append(tok)


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
JOB = re.compile(r"^(\./)?jobs/[A-Za-z0-9_\-]+\.py$")


def make_targets_named(tokens: list[str]) -> list[str]:
    """Targets of a `make ...` command (after optional VAR=value prefixes); [] otherwise."""
    k = 0
    while k < len(tokens) and ASSIGNMENT.match(tokens[k]):
        k += 1
    if k >= len(tokens) or tokens[k] != "make":
        return []
    return [t for t in tokens[k + 1:] if not ASSIGNMENT.match(t) and not t.startswith("-")]


def jobs_named(tokens: list[str]) -> list[str]:
    """Scripts under jobs/ that a python interpreter in this command runs."""
    found = []
    for k, tok in enumerate(tokens[:-1]):
        if PYTHON.search(tok):
            nxt = next((t for t in tokens[k + 1:] if not t.startswith("-")), None)
            if nxt and JOB.match(nxt):
                found.append(nxt.removeprefix("./"))
    return found


def named_in_docs():
    """{make target: [where]} and {job path: [where]} over every doc file."""
    targets, jobs = {}, {}
    for path in doc_files():
        _, code = split_doc(path)
        for snippet in code:
            for where, tokens in commands(snippet):
                for t in make_targets_named(tokens):
                    targets.setdefault(t, []).append(where)
                for j in jobs_named(tokens):
                    jobs.setdefault(j, []).append(where)
    return targets, jobs


def makefile_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.startswith(("\t", "#", " ")) or ":" not in line:
            continue
        head, _, rest = line.partition(":")
        if rest.startswith("=") or "=" in head:  # `X := y`, `X ?= y`, `X = y`
            continue
        targets.update(t for t in head.split() if "$" not in t and not t.startswith("."))
    return targets


def test_make_targets_exist():
    targets, _ = named_in_docs()
    assert targets, "no `make` command found in README.md / docs/ (the parser is broken)"
    known = makefile_targets()
    missing = [f"{where}: `make {t}`: no target '{t}' in the Makefile"
               for t, wheres in sorted(targets.items()) if t not in known for where in wheres]
    assert not missing, "make targets named in the docs but missing:\n" + "\n".join(missing)


def _help(job: str) -> tuple[str, int | None, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run([sys.executable, job, "--help"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=HELP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return job, None, f"--help still running after {HELP_TIMEOUT_S} s"
    return job, proc.returncode, (proc.stderr or proc.stdout).strip()


def test_job_commands_exist_and_help_runs():
    _, jobs = named_in_docs()
    assert jobs, "no `python jobs/...` command found in README.md / docs/ (the parser is broken)"
    problems = []
    runnable = []
    for job, wheres in sorted(jobs.items()):
        if (REPO / job).is_file():
            runnable.append(job)
        else:
            problems += [f"{where}: `python {job}`: {job} does not exist" for where in wheres]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for job, code, out in pool.map(_help, runnable):
            if code != 0:
                tail = "\n      ".join(out.splitlines()[-4:])
                named = ", ".join(jobs[job][:3]) + (f" (+{len(jobs[job]) - 3} more)" if len(jobs[job]) > 3 else "")
                problems.append(f"{named}: `python {job} --help` exited {code}:\n      {tail}")
    assert not problems, "job commands named in the docs that do not run:\n" + "\n".join(problems)


def test_readme_is_a_front_door():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md:{n}: {n} lines; the front door keeps to {README_MAX_LINES} " \
                                  f"(move detail to docs/)"


# ---------------------------------------------------------------------------- the parser itself

def test_parser_finds_what_a_reader_sees(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "Run `make demo` and [the guide](docs/guide.md#top), not `[a](missing.md)`.\n"
        "```bash\n"
        "ray job submit --working-dir . -- python jobs/train_drafter.py --config c.yaml \\\n"
        "    --set a=b   # make nothing\n"
        "make TORCH_SPEC=torch VLLM=gpu gpu-check && PYTHONPATH=. python3 jobs/gpu_check.py\n"
        "```\n"
        "See [site](https://example.org) and [here](#anchor).\n", encoding="utf-8")
    prose, code = split_doc(doc)
    links = [t for s in prose for _, t in relative_links(s)]
    assert links == ["docs/guide.md#top"]
    cmds = [tokens for s in code for _, tokens in commands(s)]
    assert [t for c in cmds for t in make_targets_named(c)] == ["demo", "gpu-check"]
    assert [j for c in cmds for j in jobs_named(c)] == ["jobs/train_drafter.py", "jobs/gpu_check.py"]
