"""The embedded long-context prompt source (specdec/longctx.py) and the LongAlign reader,
writer and builder (pipelines/longalign.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.longalign import (
    LongAlignError,
    build_longctx_set,
    convert_longalign,
    read_longalign,
    write_sequences,
)
from specdec import longctx
from specdec.prompts import _load, load_prompts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specdec.target import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path(None))


@pytest.fixture(scope="module")
def every():
    return load_prompts("longctx")


def kind_of(prompt_id: str) -> str:
    return prompt_id.split("-")[2]


# ---------------------------------------------------------------------------- longctx source


def test_longctx_is_deterministic(every):
    again = longctx.build_rows((c.id, c.turns) for c in _load("sharegpt").conversations)  # a fresh build
    assert [(p.id, p.messages) for p in every] == [(r["id"], r["messages"]) for r in again]
    assert load_prompts("longctx") == every
    assert len({p.id for p in every}) == len(every) >= 400


def test_longctx_buckets_in_both_splits(every):
    train = load_prompts("longctx", split="train")
    holdout = load_prompts("longctx", split="holdout")
    assert len(train) + len(holdout) == len(every) and not {p.id for p in train} & {p.id for p in holdout}
    for split in (train, holdout):
        assert {longctx.longctx_bucket(p.id) for p in split} == set(longctx.BUCKETS)
    counts = Counter((longctx.longctx_bucket(p.id), kind_of(p.id)) for p in every)
    assert set(counts) == {(k, kind) for k in longctx.BUCKETS for kind in longctx.KINDS}
    assert min(counts.values()) >= 30
    # the default length cap does not apply to this source; an explicit one does
    assert max(len(p.messages[0]["content"]) for p in load_prompts("longctx", split="holdout", limit=8)) > 8000
    assert all(len(p.messages[0]["content"]) <= 8000 for p in load_prompts("longctx", max_prompt_chars=8000))


def test_longctx_ids_and_shapes(every):
    for p in every:
        assert p.id.startswith(f"longctx-{longctx.longctx_bucket(p.id)}k-{kind_of(p.id)}-")
        assert [m["role"] for m in p.messages] == ["user"]
        assert "\n\nQuestion: " in p.messages[0]["content"]
    assert longctx.longctx_bucket("longctx-4k-code-argparse-12:0") == 4
    assert longctx.longctx_bucket("longctx-3k-code-x") is None and longctx.longctx_bucket("sharegpt-1") is None
    # the first rows interleave every bucket and kind, so a small limit covers them all
    assert {(longctx.longctx_bucket(p.id), kind_of(p.id)) for p in every[:8]} == \
        {(k, kind) for k in longctx.BUCKETS for kind in longctx.KINDS}
    # code questions name a function that is defined in the window shown
    code = next(p for p in every if kind_of(p.id) == "code")
    name = code.messages[0]["content"].rsplit("`", 2)[-2].split(".")[-1]
    assert f"def {name}(" in code.messages[0]["content"]


def test_longctx_lengths_in_tokens(every, tokenizer):
    from specdec.target import encode_chat

    seen = set()
    for p in every:
        key = (longctx.longctx_bucket(p.id), kind_of(p.id))
        if key in seen:
            continue
        seen.add(key)
        lo, hi = longctx.BUCKET_TOKENS[key[0]]
        n = len(encode_chat(tokenizer, p.messages))
        assert lo <= n <= hi, (p.id, n)
    assert len(seen) == 8


# ---------------------------------------------------------------------------- LongAlign reader

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Here is a long document about caches. What is a KV cache?"},
    {"role": "assistant", "content": "It stores the keys and values of past tokens."},
    {"role": "user", "content": "And why does it help?"},
    {"role": "assistant", "content": "Each new token then attends without recomputing the past."},
]


def write_lines(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_loss_mask_covers_exactly_the_assistant_turns(tmp_path, tokenizer):
    path = write_lines(tmp_path / "data.jsonl", [{"id": "a", "messages": CHAT}, "",
                                                   {"messages": CHAT[1:3]}])
    data = read_longalign(path, tokenizer, max_tokens=4096)
    assert data.lines == 2 and data.skipped_too_long == 0
    assert data.tokens == sum(len(r["input_ids"]) for r in data.rows)
    first, second = data.rows
    assert first["id"] == "a" and len(second["id"]) == 16  # sha256 of the line
    assert first["input_ids"] == tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False),
                                                  add_special_tokens=False)
    ids, mask = first["input_ids"], first["loss_mask"]
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    eot = tokenizer.eos_token  # SmolLM2: <|im_end|>, which the model must learn to emit
    assert spans == [CHAT[2]["content"] + eot, CHAT[4]["content"] + eot]
    assert second["loss_mask"].count(1) == len(tokenizer.encode(CHAT[2]["content"] + eot, add_special_tokens=False))


def test_too_long_rows_are_skipped_and_counted(tmp_path, tokenizer):
    long_chat = [{"role": "user", "content": "word " * 500}, {"role": "assistant", "content": "ok"}]
    path = write_lines(tmp_path / "data.jsonl", [{"id": "short", "messages": CHAT[1:3]},
                                                   {"id": "long", "messages": long_chat}])
    data = read_longalign(path, tokenizer, max_tokens=200)
    assert [r["id"] for r in data.rows] == ["short"] and data.skipped_too_long == 1 and data.lines == 2


@pytest.mark.parametrize("bad, field", [
    ('{"messages": [', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ({"id": "x"}, "messages: missing"),
    ({"messages": "hello"}, "messages: expected a list, got str"),
    ({"messages": [{"role": "user", "content": "q"}, "a"]}, r"messages\[1\]: expected an object, got str"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
     r"messages\[1\]\.role: expected 'user', 'assistant' or 'system', got 'bot'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
     r"messages\[1\]\.content: expected a string, got int"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages: no assistant turn"),
    ({"id": [1], "messages": CHAT}, "id: expected a string, got list"),
])
def test_malformed_lines_name_line_and_field(tmp_path, tokenizer, bad, field):
    path = write_lines(tmp_path / "data.jsonl", [{"messages": CHAT}, "", bad])
    out = tmp_path / "out.parquet"
    with pytest.raises(LongAlignError, match=rf"data\.jsonl:3: {field}"):
        convert_longalign(path, tokenizer, 4096, str(out))
    assert not out.exists() and list(tmp_path.iterdir()) == [Path(path)]


def test_written_sequences_match_what_training_reads(tmp_path, tokenizer):
    from pipelines.train.data import _normalize_sequences

    path = write_lines(tmp_path / "data.jsonl", [{"id": "a", "messages": CHAT}, {"id": "b", "messages": CHAT[1:3]}])
    out = tmp_path / "seq" / "longalign.parquet"
    data = convert_longalign(path, tokenizer, 4096, str(out))
    table = pq.read_table(out)
    assert table.schema == pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                                      ("loss_mask", pa.list_(pa.int8()))])
    assert _normalize_sequences(table).equals(table)  # what read_sequences maps every batch through
    assert table.to_pylist() == data.rows
    assert [p.name for p in out.parent.iterdir()] == ["longalign.parquet"]  # no temporary file left


# ---------------------------------------------------------------------------- builder


def test_build_longctx_set_writes_and_resumes(tmp_path):
    from specdec.target import load_target
    from specdec.tiny import save_tiny_target

    target = load_target(str(save_tiny_target(tmp_path / "tiny")))
    out = tmp_path / "longctx" / "tiny.jsonl"
    logs: list[str] = []
    first = build_longctx_set(target, out, split="all", limit=2, max_new_tokens=4, batch_size=2, log=logs.append)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert first.written == 2 and len(lines) == 2 and first.tokens == sum(x["completion_tokens"] for x in lines)
    assert {x["id"] for x in lines} == {p.id for p in load_prompts("longctx", limit=2)}
    for x in lines:
        assert [m["role"] for m in x["messages"]] == ["user", "assistant"]
        assert 1 <= x["completion_tokens"] <= 4
    assert any("2/2 prompts" in line and "ETA" in line for line in logs) and logs[-1].startswith("done: 2 prompts")
    again = build_longctx_set(target, out, split="all", limit=2, max_new_tokens=4, log=logs.append)
    assert again.written == 0 and again.already == 2 and out.read_text().count("\n") == 2
    # a run killed mid-line: the partial line is dropped and its prompt generated again
    text = out.read_text()
    out.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + '{"id": "longctx-')
    third = build_longctx_set(target, out, split="all", limit=2, max_new_tokens=4, log=logs.append)
    assert third.written == 1 and [json.loads(x)["id"] for x in out.read_text().splitlines()] == \
        [x["id"] for x in lines]


def test_write_sequences_checks_lengths_and_replaces_atomically(tmp_path):
    out = tmp_path / "seq.parquet"
    write_sequences([{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}], str(out))
    with pytest.raises(ValueError, match="row 0 \\('b'\\): 2 input_ids but 1 loss_mask"):
        write_sequences([{"id": "b", "input_ids": [1, 2], "loss_mask": [1]}], str(out))
    assert pq.read_table(out).column("id").to_pylist() == ["a"]  # the old file is intact
    write_sequences([], str(out))
    assert pq.read_table(out).num_rows == 0 and [p.name for p in tmp_path.iterdir()] == ["seq.parquet"]


def test_features_recipe_on_longctx_must_lift_the_character_cap():
    from pipelines.config import ConfigError, PromptsSection, parse_section

    with pytest.raises(ConfigError, match=r"^features\.prompts\.max_prompt_chars: .*set it to null"):
        parse_section(PromptsSection, {"source": "longctx"}, "features.prompts")
    ok = parse_section(PromptsSection, {"source": "longctx", "max_prompt_chars": None, "max_prompt_tokens": 8192},
                       "features.prompts")
    assert ok.max_prompt_tokens == 8192
