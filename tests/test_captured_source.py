"""Served traffic as a feature source (pipelines/features/captured.py), without Ray: the files
the serving replicas' capture writer (serve_app/capture.py) leaves, read back as one sample per
prompt, by window, model and temperature, split by the prompt's hash; the plan and the
captured stage's sequences; config errors naming the field. About 3 s (unit tier); the feature
run over captured traffic on Ray is tests/test_features.py's."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.config import CapturedSection, ConfigError, FeaturesConfig, parse_section
from pipelines.features.captured import capture_files, iter_captured, sample_id
from pipelines.features.plan import plan_shards
from pipelines.features.workers import CapturedAnswers
from serve_app.capture import CAPTURE_SCHEMA, CaptureWriter
from serve_app.config import CaptureSettings

pytestmark = pytest.mark.unit

UTC = datetime.timezone.utc


def record(prompt, answer, when, model="m", temperature=0.0, finish="stop", n=[0]) -> dict:
    n[0] += 1
    return {"request_id": f"r{n[0]}", "time": when, "model": model, "drafter_source": "d", "drafter_version": "1",
            "prompt_ids": prompt, "answer_ids": answer, "temperature": temperature, "top_p": 1.0, "top_k": 0,
            "max_tokens": 64, "finish_reason": finish, "accepted": [1]}


def write_day(root: Path, day: str, records: list[dict], name: str = "w-000000-000001.parquet") -> Path:
    """A capture file as the writer lays them out: ``date=<UTC day>/<writer>-<time>-<n>.parquet``."""
    folder = root / f"date={day}"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records, schema=CAPTURE_SCHEMA), folder / name)
    return folder / name


def at(day: int, hour: int = 12) -> datetime.datetime:
    return datetime.datetime(2026, 12, day, hour, tzinfo=UTC)


@pytest.fixture
def traffic(tmp_path) -> Path:
    root = tmp_path / "capture"
    write_day(root, "2026-12-01", [record([1, 2, 3], [7, 8], at(1))])
    write_day(root, "2026-12-02", [
        record([1, 2, 3], [9, 9, 9], at(2)),  # the same prompt again, another answer: one sample
        record([4, 5], [6], at(2), temperature=0.8),  # sampled: kept unless max_temperature says no
        record([4, 6], [], at(2)),  # cut at zero tokens: nothing to learn from
        record([10, 11], [12, 13], at(2, 23), model="other"),
    ])
    write_day(root, "2026-12-03", [record([20], [21, 22], at(3, 0)), record([30], [31], at(3, 9))])
    return root


def captured(root: Path, **kw) -> CapturedSection:
    return parse_section(CapturedSection, {"uris": [str(root)], **kw}, "features.prompts.captured")


def test_one_sample_per_prompt_in_path_order_without_empty_answers(traffic):
    got = list(iter_captured(captured(traffic)))
    assert [(s.prompt_ids, s.answer_ids) for s in got] == [
        ([1, 2, 3], [7, 8]), ([4, 5], [6]), ([10, 11], [12, 13]), ([20], [21, 22]), ([30], [31])]
    assert got[0].id == sample_id([1, 2, 3]) != sample_id([1, 2, 4]) and got[0].id.startswith("cap-")
    assert got[0].finish == "stop"


def test_window_model_and_temperature_filters(traffic):
    ids = lambda **kw: [s.prompt_ids for s in iter_captured(captured(traffic, **kw))]  # noqa: E731
    assert ids(since="2026-12-02T00:00:00Z", until="2026-12-03T06:00:00Z") == [[1, 2, 3], [4, 5], [10, 11], [20]]
    assert ids(since=datetime.date(2026, 12, 3)) == [[20], [30]]  # a YAML date is the day's start, UTC
    assert ids(model="m", max_temperature=0.0) == [[1, 2, 3], [20], [30]]
    assert ids(since="2026-12-03T08:00:00+08:00") == [[20], [30]]  # 00:00 UTC: the zone is honoured


def test_days_outside_the_window_are_not_opened(traffic):
    """The writer names a folder by when it wrote the file, a flush after its records: the day
    after ``until`` is still read, days before ``since`` and later ones are not (left corrupt here)."""
    (traffic / "date=2026-11-30").mkdir()
    (traffic / "date=2026-11-30" / "x.parquet").write_bytes(b"not parquet")
    (traffic / "date=2026-12-05").mkdir()
    (traffic / "date=2026-12-05" / "x.parquet").write_bytes(b"not parquet")
    files = capture_files([str(traffic)], "2026-12-01T00:00:00+00:00", "2026-12-03T10:00:00+00:00")
    assert [Path(p).parent.name for _, p in files] == ["date=2026-12-01", "date=2026-12-02", "date=2026-12-03"]
    assert len(list(iter_captured(captured(traffic, since="2026-12-01", until="2026-12-03T10:00:00Z")))) == 5


def test_splits_hash_the_prompt_so_a_prompt_is_on_one_side(tmp_path):
    root = tmp_path / "capture"
    write_day(root, "2026-12-01", [record([i, i + 1], [i], at(1)) for i in range(200)])
    write_day(root, "2026-12-02", [record([i, i + 1], [0, i], at(2)) for i in range(200)])  # asked again
    section = captured(root)
    train = {s.id for s in iter_captured(section, "train", 0.25)}
    held = {s.id for s in iter_captured(section, "holdout", 0.25)}
    every = {s.id for s in iter_captured(section, "all", 0.25)}
    assert train | held == every and not train & held and len(every) == 200
    assert 30 <= len(held) <= 70
    # the answer kept is the first one captured (day 1's), whichever split asks
    for split in ("train", "holdout", "all"):
        assert all(s.answer_ids == [s.prompt_ids[0]] for s in iter_captured(section, split, 0.25))


def test_the_capture_writers_files_are_read_back(tmp_path):
    """What serve_app's CaptureWriter writes is what the source reads."""
    writer = CaptureWriter(CaptureSettings(uri=str(tmp_path / "cap"), flush_s=0.05), "replica-1")
    now = datetime.datetime.now(UTC).timestamp()
    for i in range(5):
        assert writer.offer({**record([100 + i, 1], [2, 3, i], now), "time": now})
    writer.close()
    assert writer.stats()["captured"] == 5
    got = list(iter_captured(captured(tmp_path / "cap")))
    assert [(s.prompt_ids, s.answer_ids) for s in got] == [([100 + i, 1], [2, 3, i]) for i in range(5)]


def features_config(root: Path, **prompts) -> FeaturesConfig:
    return parse_section(FeaturesConfig, {
        "output": "unused", "generation": {"backend": "captured", "max_new_tokens": 2},
        "prompts": {"source": "captured", "split": "all", "max_prompt_tokens": 2, "captured": {"uris": [str(root)]},
                    **prompts},
        "storage": {"samples_per_shard": 2}}, "features")


def test_plan_and_captured_stage_give_prompt_plus_answer(traffic):
    shards, digest = plan_shards(features_config(traffic))
    assert [len(s.ids) for s in shards] == [2, 2, 1] and len(digest) == 64
    stage = CapturedAnswers({"max_new_tokens": 2}, max_prompt_tokens=2)
    out = [stage.sequences(s.as_row()) for s in shards]
    assert out[0]["skipped_ids"] == [sample_id([1, 2, 3])] and out[0]["skipped_reasons"] == ["prompt_too_long"]
    rows = {i: (seq, f) for o in out for i, seq, f in zip(o["ids"], o["input_ids"], o["finish_reason"])}
    assert rows[sample_id([4, 5])] == ([4, 5, 6], "stop")
    assert rows[sample_id([10, 11])] == ([10, 11, 12, 13], "stop")
    assert rows[sample_id([20])] == ([20, 21, 22], "stop")
    assert all(o["gen_tokens"] == 0 for o in out)  # read, not generated
    cut = CapturedAnswers({"max_new_tokens": 1}, max_prompt_tokens=8).sequences(shards[1].as_row())
    assert cut["input_ids"][0] == [10, 11, 12] and cut["finish_reason"][0] == "length"
    # limit and skip count captured samples as they count prompts
    assert sum(len(s.ids) for s in plan_shards(features_config(traffic, skip=1, limit=3))[0]) == 3


@pytest.mark.parametrize("features, message", [
    ({"prompts": {"source": "captured", "captured": {"uris": ["/x"]}}},
     r"^features\.generation\.backend: captured traffic already holds the target's answers"),
    ({"generation": {"backend": "captured"}}, r"^features\.generation\.backend: .* got source 'sharegpt'"),
    ({"prompts": {"source": "captured"}, "generation": {"backend": "captured"}},
     r"^features\.prompts\.captured\.uris: prompts\.source 'captured' reads served traffic"),
    ({"prompts": {"source": "captured", "captured": {"uris": ["/x"], "since": "yesterday"}},
      "generation": {"backend": "captured"}}, r"^features\.prompts\.captured\.since: expected an ISO time"),
    ({"prompts": {"source": "captured", "captured": {"uris": ["/x"], "since": "2026-12-02", "until": "2026-12-01"}},
      "generation": {"backend": "captured"}}, r"^features\.prompts\.captured\.until: .* is not after since"),
    ({"prompts": {"source": "captured", "captured": {"uris": ["/x"], "max_temperature": -1}},
      "generation": {"backend": "captured"}}, r"^features\.prompts\.captured\.max_temperature: expected number >= 0"),
    ({"prompts": {"source": "captured", "captured": {"uris": ["/x"]}},
      "generation": {"backend": "captured", "temperature": 0.7}},
     r"^features\.generation\.temperature: the captured backend generates nothing"),
])
def test_config_errors_name_the_field(features, message):
    with pytest.raises(ConfigError, match=message):
        parse_section(FeaturesConfig, {"output": "o", **features}, "features")


def test_a_missing_capture_location_and_an_empty_window_are_named(tmp_path, traffic):
    with pytest.raises(ConfigError, match=r"^features\.prompts\.captured\.uris: .*nowhere does not exist"):
        list(iter_captured(captured(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"^features\.prompts: no prompts left from captured traffic at .* \(since "
                                          r"2027-01-01"):
        plan_shards(features_config(traffic, captured={"uris": [str(traffic)], "since": "2027-01-01"}))


def test_content_names_the_captured_section_only_for_captured_runs(traffic):
    assert "captured" not in parse_section(FeaturesConfig, {"output": "o"}, "features").content()["prompts"]
    content = features_config(traffic).content()["prompts"]["captured"]
    assert content["uris"] == [str(traffic)] and content["since"] is None
    json.dumps(content)  # a run directory keeps it as JSON
