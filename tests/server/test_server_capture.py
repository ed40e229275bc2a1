"""Capture of served traffic (issue 58, docs/learning.md): a server started with capture settings
keeps, per category, the prompt and reply token ids of the requests it finished, in shards that
rotate, stay under the per-category cap and age out. On a real server over 127.0.0.1 (gRPC and the
official `openai` client), and the writer and its pruning decision alone."""

import argparse
import json
import random

import pytest

from specpair import capture
from specpair.capture import CaptureSettings, CaptureWriter, ReadCounts, Shard, parse_shard, read_records, shards_to_delete
from specpair.errors import SpecpairError
from specpair.server.cli import add_engine_parser, server_options

from serving_helpers import client_for, make_engine, openai_client, wait_for

PROMPTS = ["def foo(x):", "import os", "class A:", "for i in range(3):", "x = [1, 2", "while True:", "print("]


def metric(server, category: str, outcome: str) -> float:
    labels = {"pair": server.options.pair, "version": server.options.version, "engine": "specpair",
              "category": category, "outcome": outcome}
    return server.metrics.registry.get_sample_value("specpair_capture_records_total", labels) or 0.0


def complete_shards(directory, category: str) -> list[Shard]:
    folder = directory / capture.category_dirname(category)
    return sorted((s for s in map(parse_shard, (p.name for p in folder.iterdir())) if s and s.complete),
                  key=lambda s: (s.time, s.name))


def test_a_server_captures_the_token_ids_it_served_per_category_capped(tiny_pair, start_server, tmp_path):
    settings = CaptureSettings(directory=str(tmp_path), sample_rate=1.0, per_category_cap=4, shard_records=2)
    server = start_server(engine=make_engine(tiny_pair), http_port=0, version="7", capture=settings)
    served = []                         # (prompt, reply token ids) of the gRPC category, in order
    with client_for(server) as c:
        for prompt in PROMPTS:
            reply = c.generate(prompt, max_new_tokens=6, category="code", timeout=60)
            served.append((prompt, reply.token_ids))
    http = openai_client(server)
    texts = [http.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0,
                                     extra_body={"specpair": {"category": "prose"}}).choices[0].text
             for p in PROMPTS[:3]]
    encode, decode = server.engine.encode, server.engine.target.tokenizer.decode
    # Offered as each request ends, just after its reply went out; written in the capture's thread.
    assert wait_for(lambda: server.capture.written == len(PROMPTS) + 3) and server.capture.dropped == 0
    # GetStats reports the records in the folder's complete shards (a training waits for enough,
    # issue 58): 7 'code' in shards of 2 -> 3 closed, of which the cap of 4 keeps 2 (4 records;
    # the 7th's shard is open), 3 'prose' -> 1 closed (2); another pod's complete shard counts too.
    (tmp_path / "code" / capture.complete_name(0.0, "other-pod", 1, 5)).write_text("")
    with client_for(server) as c:
        assert dict(c.stats().captured) == {"code": 4 + 5, "prose": 2}
    server.stop(drain_timeout=5)       # closes the open shards

    code = list(read_records(tmp_path, "code"))
    # The cap keeps the newest: 7 records in shards of 2 -> shards of 2, 2, 2, 1; past 4 the oldest go.
    assert sum(s.records for s in complete_shards(tmp_path, "code")) <= 4
    kept = served[-len(code):]
    assert len(code) >= 3, code
    for record, (prompt, reply_ids) in zip(code, kept):
        assert record["reply_ids"] == reply_ids and record["prompt_ids"] == encode(prompt)
        assert record["category"] == "code" and record["release"] == "7" and record["v"] == capture.FORMAT_VERSION
        assert record["tokenizer"] == server.engine.target_fingerprint["sha256"]
        assert set(record) == {"v", "category", "prompt_ids", "reply_ids", "release", "tokenizer", "time"}
    prose = list(read_records(tmp_path, "prose"))
    assert [decode(r["reply_ids"], skip_special_tokens=True) for r in prose] == texts
    assert [r["prompt_ids"] for r in prose] == [encode(p) for p in PROMPTS[:3]]
    assert metric(server, "code", "written") == len(PROMPTS) and metric(server, "prose", "written") == 3
    assert not list(tmp_path.glob("*/*.open")), "a stopped server leaves no open shard"


def test_capture_is_off_unless_asked(tiny_pair, start_server, tmp_path):
    server = start_server(engine=make_engine(tiny_pair))
    with client_for(server) as c:
        c.generate("def foo(x):", max_new_tokens=2, timeout=30)
    assert server.capture is None and server.worker.on_finished is None


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["engine", "serve", "--insecure", *flags])


def test_the_cli_turns_capture_on_only_with_a_directory_and_refuses_bad_settings(tmp_path):
    assert server_options(serve_args()).capture is None
    settings = server_options(serve_args("--capture-dir", str(tmp_path), "--capture-rate", "0.25",
                                         "--capture-cap", "100", "--capture-retention", "3600")).capture
    assert (settings.directory, settings.sample_rate, settings.per_category_cap,
            settings.retention_seconds) == (str(tmp_path), 0.25, 100, 3600)
    defaults = server_options(serve_args("--capture-dir", str(tmp_path))).capture
    assert (defaults.sample_rate, defaults.per_category_cap, defaults.retention_seconds) == (
        capture.DEFAULT_SAMPLE_RATE, capture.DEFAULT_PER_CATEGORY_CAP, capture.DEFAULT_RETENTION_SECONDS)
    for flags, words in ((("--capture-rate", "0"), "--capture-rate"), (("--capture-rate", "1.5"), "--capture-rate"),
                         (("--capture-cap", "0"), "--capture-cap"), (("--capture-retention", "1"), "--capture-retention")):
        with pytest.raises(SpecpairError, match=words):
            server_options(serve_args("--capture-dir", str(tmp_path), *flags))


# -- the writer and the pruning decision --------------------------------------------------------

class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_sampling_keeps_about_the_rate_and_a_full_queue_drops_without_waiting(tmp_path):
    counted = []
    writer = CaptureWriter(CaptureSettings(directory=str(tmp_path), sample_rate=0.3, queue_size=10_000),
                           release="1", pod="p", counted=lambda *a: counted.append(a), rng=random.Random(5))
    writer.start()
    for i in range(2000):
        writer.offer("code", [1, 2, i], [3, 4])
    writer.flush()
    writer.stop()
    # Binomial(2000, 0.3): mean 600, sd 20.5; a seeded draw, and a bound no rate but ~0.3 meets.
    assert 520 < writer.written < 680 and writer.dropped == 0
    assert len(list(read_records(tmp_path, "code"))) == writer.written
    full = CaptureWriter(CaptureSettings(directory=str(tmp_path), sample_rate=1.0, queue_size=2), release="1",
                         pod="p", counted=lambda *a: counted.append(a))
    for _ in range(5):                # not started: nothing drains the queue
        full.offer("code", [1], [2])
    assert full.dropped == 3 and counted.count(("code", "dropped", 1)) == 3


def test_shards_rotate_by_size_and_age_and_age_out_past_the_retention(tmp_path):
    clock = Clock()
    writer = CaptureWriter(CaptureSettings(directory=str(tmp_path), sample_rate=1.0, retention_seconds=3600,
                                           shard_records=3, shard_seconds=60),
                           release="2", pod="engine-abc-1", clock=clock)
    for i in range(4):
        writer._write("code", [i], [i + 1], clock())
    assert [s.records for s in complete_shards(tmp_path, "code")] == [3]      # rotated by size
    assert len(list((tmp_path / "code").glob("*.open"))) == 1
    clock.t += 61
    writer._rotate_due()                                                       # rotated by age
    assert [s.records for s in complete_shards(tmp_path, "code")] == [3, 1]
    assert [r["prompt_ids"] for r in read_records(tmp_path, "code")] == [[0], [1], [2], [3]]
    clock.t += 3601
    writer._write("code", [9], [9], clock())
    writer.prune_all()
    assert complete_shards(tmp_path, "code") == [], "shards older than the retention are deleted"
    assert len(list((tmp_path / "code").glob("*.open"))) == 1, "the shard being written is kept"


def test_the_pruning_decision_keeps_the_newest_records_under_the_cap():
    t0 = 1_800_000_000.0
    shards = [Shard(f"s{i}", t0 + i * 10, 5, True) for i in range(6)] + [Shard("open", t0 + 55, 0, False),
                                                                          Shard("stale-open", t0 - 5000, 0, False)]
    now = t0 + 100
    assert shards_to_delete(shards, now=now, cap=30, retention_seconds=3600) == ["stale-open"]
    assert shards_to_delete(shards, now=now, cap=12, retention_seconds=3600) == ["stale-open", "s0", "s1", "s2", "s3"]
    assert shards_to_delete(shards, now=now, cap=12, retention_seconds=3600, keep=frozenset({"s0"})) == \
        ["stale-open", "s1", "s2", "s3"]
    assert sorted(shards_to_delete(shards, now=t0 + 4000, cap=100, retention_seconds=3975)) == ["s0", "s1", "s2",
                                                                                                "stale-open"]


def test_names_carry_what_pruning_needs_and_odd_categories_stay_inside_their_folder(tmp_path):
    name = capture.complete_name(1_800_000_123.0, "engine-7f9-x2", 12, 256)
    assert parse_shard(name) == Shard(name, 1_800_000_123.0, 256, True)
    assert parse_shard("notes.txt") is None
    assert [capture.category_dirname(c) for c in (".", "..", "a.b")] == ["%2E", "%2E%2E", "a.b"]
    writer = CaptureWriter(CaptureSettings(directory=str(tmp_path), sample_rate=1.0), release="1", pod="p")
    writer._write("..", [1], [2], 0.0)
    writer._close("..")
    assert (tmp_path / "%2E%2E").is_dir() and capture.categories(tmp_path) == [".."]
    assert [r["reply_ids"] for r in read_records(tmp_path, "..")] == [[2]]


def test_a_reader_skips_a_cut_line_and_refuses_another_format_version(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    good = {"v": 1, "category": "code", "prompt_ids": [1], "reply_ids": [2], "release": "1", "tokenizer": "", "time": 0}
    (folder / capture.complete_name(100.0, "p", 1, 2)).write_text(json.dumps(good) + "\n" + '{"v": 1, "prom')
    (folder / capture.open_name(200.0, "p", 2)).write_text(json.dumps(good) + "\n")   # never read
    counts = ReadCounts()
    assert list(read_records(tmp_path, "code", counts)) == [good] and (counts.records, counts.skipped) == (1, 1)
    (folder / capture.complete_name(300.0, "p", 3, 1)).write_text(json.dumps({**good, "v": 2}) + "\n")
    with pytest.raises(SpecpairError, match="version 2"):
        list(read_records(tmp_path, "code"))
    assert list(read_records(tmp_path, "absent")) == []


def test_a_capture_folder_that_cannot_be_written_drops_records_and_serving_goes_on(tiny_pair, start_server, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    server = start_server(engine=make_engine(tiny_pair), capture=CaptureSettings(directory=str(blocked / "capture"),
                                                                                 sample_rate=1.0))
    with client_for(server) as c:
        assert c.generate("def foo(x):", max_new_tokens=3, category="code", timeout=30).token_ids
    assert wait_for(lambda: server.capture.dropped == 1)
    assert server.capture.written == 0 and metric(server, "code", "dropped") == 1
