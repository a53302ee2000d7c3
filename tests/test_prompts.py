"""Tests for specdec.prompts: every source kind, the split rule, dedup, caps and errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from specdec import assets
from specdec import prompts as prompts_module
from specdec.prompts import Prompt, is_holdout, iter_prompts, load_prompts, prompt_text

pytestmark = pytest.mark.unit


def write_json(path: Path, data) -> str:
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def sharegpt_conv(conv_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": conv_id, "conversations": [{"from": who, "value": text} for who, text in turns]}


def split_rule(key: str, fraction: float) -> bool:
    """The documented rule, restated independently of the implementation."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def ids(prompts: list[Prompt]) -> list[str]:
    return [p.id for p in prompts]


# ---------------------------------------------------------------------------- builtins


def test_builtin_humaneval_has_164_code_completion_prompts():
    with gzip.open(assets.humaneval_jsonl(), "rt") as f:
        rows = [json.loads(line) for line in f]
    prompts = load_prompts("humaneval")

    assert len(prompts) == 164
    assert ids(prompts) == [row["task_id"] for row in rows]
    for prompt, row in zip(prompts, rows):
        assert [m["role"] for m in prompt.messages] == ["user"]
        text = prompt_text(prompt)
        assert text.startswith("Complete the following Python function:\n```python\n")
        assert row["prompt"].strip() in text
        assert text.endswith("```")
        assert prompt.reference is None
    assert "def has_close_elements" in prompt_text(prompts[0])


def test_builtin_sharegpt_loads_first_turns_and_caches():
    prompts = load_prompts("sharegpt", limit=50)  # parses the whole packaged file once

    assert len(prompts) == 50
    assert prompts[0].id == "QWJhYvA_0"
    assert prompt_text(prompts[0]).startswith("Summarize the main ideas of Jeff Walker's Product Launch")
    assert prompts[0].reference and "Product Launch Formula" in prompts[0].reference
    assert len(set(ids(prompts))) == 50
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        assert {m["role"] for m in p.messages} <= {"system", "user"}
        assert 1 <= sum(len(m["content"]) for m in p.messages) <= 8000

    hits = prompts_module._parse_cached.cache_info().hits
    start = time.perf_counter()
    everything = load_prompts("sharegpt")
    holdout = load_prompts("sharegpt", split="holdout")
    elapsed = time.perf_counter() - start
    assert prompts_module._parse_cached.cache_info().hits == hits + 2  # parsed once per process
    assert elapsed < 5, f"cached ShareGPT reloads took {elapsed:.1f}s"
    assert everything[:50] == prompts
    assert len(everything) > 5000
    assert 0.03 < len(holdout) / len(everything) < 0.07
    assert all(split_rule(p.id, 0.05) for p in holdout)


# ---------------------------------------------------------------------------- ShareGPT files


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> str:
    return write_json(
        tmp_path / "chats.json",
        [
            sharegpt_conv(
                "a",
                ("system", "Be brief."),
                ("human", "What is 2+2?"),
                ("gpt", "4"),
                ("human", "And 3+3?"),
                ("gpt", "6"),
                ("human", "Thanks, bye"),
            ),
            sharegpt_conv("b", ("human", "Name a colour."), ("gpt", "Blue.")),
            sharegpt_conv("c", ("gpt", "continuation of an earlier chunk"), ("human", "ok")),
            sharegpt_conv("d"),
            sharegpt_conv("e", ("human", "Hello"), ("human", "Anyone there?"), ("bing", "Yes.")),
            sharegpt_conv("f", ("human", "hi"), ("alien", "???")),
        ],
    )


def test_sharegpt_first_turn_mode(sharegpt_file: str):
    prompts = load_prompts(sharegpt_file)

    assert ids(prompts) == ["a", "b", "e"]
    a, b, e = prompts
    assert a.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert a.reference == "4"
    assert b.reference == "Blue."
    assert prompt_text(e) == "Hello"
    assert e.reference is None  # the next turn is another human turn, not an answer


def test_sharegpt_multi_turn_mode(sharegpt_file: str):
    prompts = {p.id: p for p in load_prompts(sharegpt_file, multi_turn=True)}

    assert list(prompts) == ["a:0", "a:1", "a:2", "b:0", "e:0", "e:1"]
    assert [m["role"] for m in prompts["a:1"].messages] == ["system", "user", "assistant", "user"]
    assert prompt_text(prompts["a:1"]) == "And 3+3?"
    assert prompts["a:1"].reference == "6"
    assert prompts["a:2"].reference is None
    assert len(prompts["a:2"].messages) == 6
    assert prompts["e:1"].messages[0] == {"role": "user", "content": "Hello"}
    assert prompts["e:1"].reference == "Yes."  # "bing" is an assistant alias


def test_multi_turn_prompts_share_their_conversation_split(tmp_path: Path):
    rows = [
        sharegpt_conv(f"c{i}", ("human", f"q{i}.0"), ("gpt", "a"), ("human", f"q{i}.1"), ("gpt", "b"))
        for i in range(200)
    ]
    path = write_json(tmp_path / "chats.json", rows)
    holdout = load_prompts(path, split="holdout", multi_turn=True, holdout_fraction=0.3)
    train = load_prompts(path, split="train", multi_turn=True, holdout_fraction=0.3)

    holdout_convs = {p.id.split(":")[0] for p in holdout}
    train_convs = {p.id.split(":")[0] for p in train}
    assert holdout_convs and train_convs
    assert not holdout_convs & train_convs
    assert len(holdout) == 2 * len(holdout_convs)
    assert all(split_rule(c, 0.3) for c in holdout_convs)


def test_truncated_json_list_keeps_complete_elements(tmp_path: Path, caplog):
    rows = [sharegpt_conv(f"id{i}", ("human", f"question {i}"), ("gpt", "answer")) for i in range(3)]
    text = json.dumps(rows, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"question 2"')], encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="specdec.prompts"):
        prompts = load_prompts(str(path))

    assert ids(prompts) == ["id0", "id1"]
    assert "2 complete elements" in caplog.text


def test_corrupt_complete_json_list_is_an_error(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text('[{"id": "x", "conversations": [}]', encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        load_prompts(str(path))


# ---------------------------------------------------------------------------- split


@pytest.fixture
def two_thousand(tmp_path: Path) -> str:
    rows = [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(2000)]
    return write_jsonl(tmp_path / "p.jsonl", rows)


def test_holdout_and_train_partition_all(two_thousand: str):
    every = ids(load_prompts(two_thousand))
    train = ids(load_prompts(two_thousand, split="train"))
    holdout = ids(load_prompts(two_thousand, split="holdout"))

    assert len(every) == 2000
    assert not set(train) & set(holdout)
    assert sorted(train + holdout, key=every.index) == every
    # Each split keeps source order.
    assert train == [i for i in every if i in set(train)]
    assert holdout == [i for i in every if split_rule(i, 0.05)]
    assert 0.035 <= len(holdout) / 2000 <= 0.065


def test_holdout_fraction_is_respected(two_thousand: str):
    holdout = ids(load_prompts(two_thousand, split="holdout", holdout_fraction=0.2))
    assert 0.17 <= len(holdout) / 2000 <= 0.23
    assert holdout == [f"p{i}" for i in range(2000) if is_holdout(f"p{i}", 0.2)]
    assert load_prompts(two_thousand, split="holdout", holdout_fraction=0.0) == []
    assert len(load_prompts(two_thousand, split="train", holdout_fraction=0.0)) == 2000


def test_loading_is_deterministic_across_files(tmp_path: Path):
    rows = [{"prompt": f"question {i}"} for i in range(300)]  # no ids: content hashes
    first = load_prompts(write_jsonl(tmp_path / "one.jsonl", rows), split="holdout", holdout_fraction=0.3)
    again = load_prompts(write_jsonl(tmp_path / "two.jsonl", rows), split="holdout", holdout_fraction=0.3)

    assert first and ids(first) == ids(again)
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids(first))
    every = ids(load_prompts(str(tmp_path / "one.jsonl")))
    assert len(set(every)) == 300


# ---------------------------------------------------------------------------- filters


def test_dedup_keeps_first_copy_after_whitespace_normalisation(tmp_path: Path):
    rows = [
        {"id": "first", "prompt": "Tell me  a joke."},
        {"id": "other", "prompt": "Tell me a story."},
        {"id": "copy", "prompt": "  Tell me a\n joke. "},
        {"id": "system-differs", "messages": [
            {"role": "system", "content": "x"}, {"role": "user", "content": "Tell me a joke."}]},
    ]
    path = write_jsonl(tmp_path / "dups.jsonl", rows)

    assert ids(load_prompts(path)) == ["first", "other", "system-differs"]
    assert ids(load_prompts(path, dedup=False)) == ["first", "other", "copy", "system-differs"]


def test_dedup_never_puts_one_text_in_both_splits(tmp_path: Path):
    # Find ids that land on opposite sides of the split and give them the same text.
    holdout_id = next(f"h{i}" for i in range(10_000) if split_rule(f"h{i}", 0.5))
    train_id = next(f"t{i}" for i in range(10_000) if not split_rule(f"t{i}", 0.5))
    rows = [{"id": holdout_id, "prompt": "same"}, {"id": train_id, "prompt": "same"}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)

    assert ids(load_prompts(path, split="holdout", holdout_fraction=0.5)) == [holdout_id]
    assert load_prompts(path, split="train", holdout_fraction=0.5) == []
    assert ids(load_prompts(path, split="train", holdout_fraction=0.5, dedup=False)) == [train_id]


def test_length_caps_count_all_message_characters(tmp_path: Path):
    rows = [
        {"id": "short", "prompt": "x" * 5},
        {"id": "medium", "prompt": "x" * 50},
        {"id": "long", "prompt": "x" * 500},
        {"id": "with-system", "messages": [
            {"role": "system", "content": "s" * 60}, {"role": "user", "content": "y" * 50}]},
        {"id": "blank", "messages": [
            {"role": "system", "content": "s" * 20}, {"role": "user", "content": "  "}]},
    ]
    path = write_jsonl(tmp_path / "lengths.jsonl", rows)

    assert ids(load_prompts(path, max_prompt_chars=100, min_prompt_chars=10)) == ["medium"]
    assert ids(load_prompts(path, max_prompt_chars=110)) == ["short", "medium", "with-system"]
    assert ids(load_prompts(path, max_prompt_chars=None)) == ["short", "medium", "long", "with-system"]
    assert ids(load_prompts(path, max_prompt_chars=None, min_prompt_chars=51)) == ["long", "with-system"]


def test_limit_takes_the_first_prompts_after_filtering(two_thousand: str):
    holdout = load_prompts(two_thousand, split="holdout")
    assert load_prompts(two_thousand, split="holdout", limit=3) == holdout[:3]
    assert load_prompts(two_thousand, limit=0) == []
    first = next(iter_prompts(two_thousand, split="holdout"))
    assert first == holdout[0]
    # skip: a second run over the prompts after the first N, never overlapping them
    assert load_prompts(two_thousand, split="holdout", skip=3, limit=4) == holdout[3:7]
    assert load_prompts(two_thousand, split="holdout", skip=5) == holdout[5:]


# ---------------------------------------------------------------------------- file formats


CHAT_ROWS = [
    {"id": "m1", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello"}]},
    {"id": 7, "messages": [{"role": "user", "content": "only a question"}]},
]


def test_jsonl_with_messages(tmp_path: Path):
    prompts = load_prompts(write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS))

    assert ids(prompts) == ["m1", "7"]
    assert prompts[0].messages == CHAT_ROWS[0]["messages"][:2]
    assert prompts[0].reference == "hello"
    assert prompts[1].messages == [{"role": "user", "content": "only a question"}]
    assert prompts[1].reference is None


@pytest.mark.parametrize("name", ["plain.jsonl", "packed.jsonl.gz"])
def test_jsonl_with_prompt_strings(tmp_path: Path, name: str):
    path = write_jsonl(tmp_path / name, [{"id": "q1", "prompt": "Why is the sky blue?"}, {"prompt": "2+2?"}])
    prompts = load_prompts(path)

    assert prompts[0] == Prompt("q1", [{"role": "user", "content": "Why is the sky blue?"}], None)
    assert prompts[1].messages == [{"role": "user", "content": "2+2?"}]
    assert len(prompts[1].id) == 16


def test_parquet(tmp_path: Path):
    table = pa.table({
        "id": ["p1", "p2", "p3"],
        "prompt": ["plain prompt", None, None],
        "messages": [
            None,
            [{"role": "user", "content": "chat prompt"}, {"role": "assistant", "content": "ok"}],
            None,
        ],
        "input_ids": [[1, 2], [3], [4]],  # an unrelated column is ignored
    })
    pq.write_table(table, tmp_path / "p.parquet")
    prompts = load_prompts(str(tmp_path / "p.parquet"))

    assert ids(prompts) == ["p1", "p2"]  # p3 has neither field: skipped
    assert prompt_text(prompts[0]) == "plain prompt"
    assert prompts[1].messages == [{"role": "user", "content": "chat prompt"}]
    assert prompts[1].reference == "ok"


def save_to_disk_dir(directory: Path, table: pa.Table, *, stream: bool = True) -> str:
    """Lay out ``directory`` as datasets' save_to_disk does, without the datasets package."""
    directory.mkdir()
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(directory / name), "wb") as sink:
        writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with writer(sink, table.schema) as w:
            w.write_table(table)
    (directory / "dataset_info.json").write_text("{}")
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
    return str(directory)


@pytest.mark.parametrize("stream", [True, False], ids=["ipc-stream", "ipc-file"])
def test_save_to_disk_directory(tmp_path: Path, stream: bool):
    table = pa.table({
        "id": ["s1", "s2"],
        "conversations": [
            [{"from": "human", "value": "first"}, {"from": "gpt", "value": "reply"}],
            [{"from": "human", "value": "second"}],
        ],
    })
    prompts = load_prompts(save_to_disk_dir(tmp_path / "ds", table, stream=stream))

    assert ids(prompts) == ["s1", "s2"]
    assert prompts[0].messages == [{"role": "user", "content": "first"}]
    assert prompts[0].reference == "reply"


def test_save_to_disk_directory_with_messages_column(tmp_path: Path):
    table = pa.table({"messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]})
    prompts = load_prompts(save_to_disk_dir(tmp_path / "ds", table))
    assert [prompt_text(p) for p in prompts] == ["a", "b"]


def test_rewritten_file_is_reparsed(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"id": "old", "prompt": "old"}])
    assert ids(load_prompts(str(path))) == ["old"]
    write_jsonl(path, [{"id": "new", "prompt": "brand new"}])
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert ids(load_prompts(str(path))) == ["new"]


# ---------------------------------------------------------------------------- errors


def test_unknown_source_lists_accepted_kinds(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown prompt source 'sharegtp'") as err:
        load_prompts("sharegtp")
    for kind in ("'sharegpt'", "'humaneval'", ".jsonl", ".parquet", "save_to_disk"):
        assert kind in str(err.value)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown prompt source"):
        load_prompts(str(tmp_path / "data.csv"))


def test_missing_file_and_non_dataset_directory(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"no \*\.arrow files"):
        load_prompts(str(tmp_path))


def test_dataset_dict_directory_asks_for_a_split(tmp_path: Path):
    root = tmp_path / "dd"
    root.mkdir()
    (root / "dataset_dict.json").write_text('{"splits": ["train"]}')
    save_to_disk_dir(root / "train", pa.table({"prompt": ["x"]}))
    with pytest.raises(ValueError, match=r"DatasetDict.*\['train'\]"):
        load_prompts(str(root))
    assert [prompt_text(p) for p in load_prompts(str(root / "train"))] == ["x"]


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "test"}, "split must be one of 'all', 'train', 'holdout'; got 'test'"),
    ({"holdout_fraction": 1.5}, "holdout_fraction must be in"),
    ({"limit": -1}, "limit must be"),
    ({"skip": -2}, "skip must be >= 0"),
    ({"max_prompt_chars": 5, "min_prompt_chars": 10}, "below min_prompt_chars"),
])
def test_bad_arguments(two_thousand: str, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        load_prompts(two_thousand, **kwargs)


def test_file_without_usable_fields_names_the_expected_ones(tmp_path: Path):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    message = str(err.value)
    assert "no usable rows" in message
    for field in ("'messages'", "'prompt'", "'conversations'"):
        assert field in message
    assert "skipped 2" in message


def test_rows_without_fields_are_skipped_and_reported(tmp_path: Path, caplog):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"text": "b"}, {"prompt": "c"}])
    with caplog.at_level(logging.WARNING, logger="specdec.prompts"):
        prompts = load_prompts(path)
    assert [prompt_text(p) for p in prompts] == ["a", "c"]
    assert "skipped 1 of 3 rows" in caplog.text


def test_empty_and_malformed_jsonl(tmp_path: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="contains no rows"):
        load_prompts(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: invalid JSON"):
        load_prompts(str(broken))
