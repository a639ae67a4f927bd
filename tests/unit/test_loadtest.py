"""Unit tests of the load tester's pieces: configuration, conversations, statistics,
metrics parsing (against the real kvserve exposition) and the report files."""

from __future__ import annotations

import io
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from engine.outputs import EngineStats, PoolStats
from loadtest.client import STATUS_CANCELLED, ChatRequest, RequestRecord, _apply_chunk
from loadtest.config import SLO, LengthDist, LoadTestConfig
from loadtest.plot import plot_report
from loadtest.progress import ProgressBar
from loadtest.prompts import Conversation, shared_system_prompt
from loadtest.report import build_result, format_summary
from loadtest.runner import RunResult
from loadtest.scrape import METRICS, parse_metrics
from loadtest.stats import longest_output_stall, percentile, summarize, throughput_series
from server.metrics import ServerMetrics


def _record(
    start: float, ttft: float, gaps: list[float], *, status: str = "ok", prompt: int = 10
) -> RequestRecord:
    """A finished request whose tokens arrived at known times."""
    times = [start + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        conversation_id=0,
        turn=0,
        start=start,
        status=status,
        first_token_time=times[0],
        end=times[-1],
        chunk_times=times,
        prompt_tokens=prompt,
        completion_tokens=len(times),
        usage_reported=True,
    )


class TestLengthDist:
    def test_parse_forms(self) -> None:
        assert LengthDist.parse("32") == LengthDist("fixed", 32)
        assert LengthDist.parse("uniform:64:16") == LengthDist("uniform", 64, 16.0)
        assert LengthDist.parse("lognormal:64:0.5") == LengthDist("lognormal", 64, 0.5)
        for bad in ("", "x", "uniform:64", "gauss:1:2", "0", "uniform:10:-1"):
            with pytest.raises(ValueError):
                LengthDist.parse(bad)

    def test_samples_follow_the_distribution(self) -> None:
        rng = random.Random(1)
        assert {LengthDist("fixed", 7).sample(rng) for _ in range(20)} == {7}
        uniform = [LengthDist("uniform", 50, 10).sample(rng) for _ in range(2000)]
        assert min(uniform) == 40 and max(uniform) == 60
        lognormal = [LengthDist("lognormal", 100, 0.5).sample(rng) for _ in range(4000)]
        assert 90 <= statistics.median(lognormal) <= 110
        assert max(lognormal) > 200  # a heavy right tail


class TestConfig:
    def test_url_is_normalised_to_the_server_root(self) -> None:
        assert LoadTestConfig(url="http://h:1/v1/").base_url == "http://h:1"
        assert LoadTestConfig(url="http://h:1").base_url == "http://h:1"

    def test_request_limit(self) -> None:
        assert LoadTestConfig(concurrency=4, turns=5).request_limit == 20
        assert LoadTestConfig(concurrency=4, turns=5, num_conversations=10).request_limit == 50
        assert LoadTestConfig(concurrency=4, turns=5, max_requests=7).request_limit == 7

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"url": "127.0.0.1:8000"},
            {"concurrency": 0},
            {"turns": 0},
            {"max_tokens": 0},
            {"request_rate": 0.0},
            {"duration_s": -1.0},
            {"think_time_s": -0.1},
            {"max_requests": 0},
        ],
    )
    def test_rejects_bad_values(self, kwargs: dict[str, object]) -> None:
        with pytest.raises(ValueError):
            LoadTestConfig(**kwargs)  # type: ignore[arg-type]


class TestConversation:
    def test_history_grows_turn_by_turn(self) -> None:
        system = shared_system_prompt(8, seed=0)
        conv = Conversation.create(
            3, turns=2, user_len=LengthDist("fixed", 5), seed=0, system_prompt=system
        )
        first = conv.next_user_message()
        assert [m["role"] for m in first] == ["system", "user"]
        assert first[1]["content"].startswith("[conversation 3] ")
        assert len(first[1]["content"].split()) == 5 + 2
        conv.record_reply("hello there")
        second = conv.next_user_message()
        assert second[:3] == [*first, {"role": "assistant", "content": "hello there"}]
        assert len(second[3]["content"].split()) == 5
        conv.record_reply("")
        assert conv.finished

    def test_same_seed_same_conversation(self) -> None:
        make = lambda seed: Conversation.create(  # noqa: E731
            1, turns=1, user_len=LengthDist("uniform", 20, 10), seed=seed, system_prompt=None
        )
        assert make(5).next_user_message() == make(5).next_user_message()
        assert make(5).next_user_message() != make(6).next_user_message()

    def test_failed_turn_drops_its_message_and_counts(self) -> None:
        conv = Conversation.create(0, turns=2, user_len=LengthDist(), seed=0, system_prompt=None)
        conv.next_user_message()
        conv.abandon_turn()
        assert conv.messages == [] and conv.turns_done == 1

    def test_shared_system_prompt_is_shared(self) -> None:
        assert shared_system_prompt(0, seed=1) is None
        assert shared_system_prompt(10, seed=1) == shared_system_prompt(10, seed=1)


class TestStreamParsing:
    def test_role_chunk_is_not_the_first_token(self) -> None:
        record = RequestRecord(0, 0, start=0.0)
        _apply_chunk(record, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)
        _apply_chunk(record, {"choices": [{"delta": {"content": "Hi"}}]}, 0.3)
        _apply_chunk(record, {"choices": [{"delta": {}, "finish_reason": "stop"}]}, 0.4)
        usage = {
            "prompt_tokens": 9,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
        _apply_chunk(record, {"choices": [], "usage": usage}, 0.5)
        assert record.ttft == 0.3 and record.text == "Hi" and record.finish_reason == "stop"
        assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (9, 1, 4)

    def test_error_chunk_marks_the_request_failed(self) -> None:
        record = RequestRecord(0, 0, start=0.0)
        _apply_chunk(record, {"error": {"message": "engine died"}}, 0.2)
        assert not record.ok and record.status == "stream_error"
        assert "engine died" in (record.error or "")

    def test_request_body(self) -> None:
        body = ChatRequest("m", [{"role": "user", "content": "x"}], 8, 0.0, False).body()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert "ignore_eos" not in body and "seed" not in body
        assert ChatRequest("m", [], 8, 0.5, True, seed=3).body()["ignore_eos"] is True


class TestStatistics:
    def test_percentile_matches_numpy(self) -> None:
        values = [random.Random(2).random() for _ in range(101)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
        assert percentile([], 50) is None

    def test_summary_of_known_records(self) -> None:
        records = [
            _record(0.0, 0.5, [0.1, 0.1, 0.1]),
            _record(1.0, 1.5, [0.3]),
            _record(2.0, 0.2, [], status="http_500"),
            _record(2.0, 0.2, [], status=STATUS_CANCELLED),
        ]
        summary = summarize(records, duration_s=4.0, slo=SLO(ttft_s=1.0, itl_s=0.2))
        assert summary["requests"]["completed"] == 2
        assert summary["requests"]["failed"] == 1 and summary["requests"]["cancelled"] == 1
        assert summary["requests"]["error_rate"] == pytest.approx(1 / 3)
        assert summary["requests"]["errors_by_status"] == {"http_500": 1}
        # The cancelled request's token counts towards throughput, the failed one's not.
        assert summary["tokens"] == {
            "prompt": 30,
            "output": 7,
            "cached_prompt": None,
            "cached_fraction": None,
        }
        assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(7 / 4)
        assert summary["throughput"]["total_tokens_per_s"] == pytest.approx(37 / 4)
        assert summary["throughput"]["request_rate"] == pytest.approx(0.5)
        latency = summary["latency_s"]
        # The cut-off request measured its first token; the failed one counts nowhere.
        assert latency["ttft"]["count"] == 3 and latency["ttft"]["p50"] == pytest.approx(0.5)
        assert latency["itl"]["count"] == 4 and latency["itl"]["p50"] == pytest.approx(0.1)
        assert latency["e2e"]["max"] == pytest.approx(1.8)
        # Only the first request meets TTFT <= 1 s and mean ITL <= 0.2 s.
        assert summary["goodput"]["good_requests"] == 1
        assert summary["goodput"]["output_tokens_per_s"] == pytest.approx(4 / 4)

    def test_longest_output_stall_counts_only_time_someone_waits(self) -> None:
        # Tokens at 0.5 0.6 0.7 (first request), 2.5 (second, which started at 1.0): no
        # token from 0.7 to 2.5 though only the second request waited from 1.0 on.
        records = [_record(0.0, 0.5, [0.1, 0.1]), _record(1.0, 1.5, [0.2])]
        assert longest_output_stall(records) == pytest.approx(1.5)
        # A third request in flight over the idle time makes the whole gap a stall.
        records.append(_record(0.6, 2.0, []))
        assert longest_output_stall(records) == pytest.approx(1.8)
        # Waiting for a first token counts too; no requests, no stall.
        assert longest_output_stall([_record(5.0, 3.0, [0.1])]) == pytest.approx(3.0)
        assert longest_output_stall([]) == 0.0

    def test_throughput_series_sums_to_the_output_tokens(self) -> None:
        records = [_record(0.0, 0.5, [0.4] * 9), _record(0.0, 1.0, [1.0] * 4)]
        records[0].completion_tokens = 20  # two tokens per chunk
        series = throughput_series(records, duration_s=5.0)
        assert [p["t"] for p in series] == [0.5, 1.5, 2.5, 3.5, 4.5]
        assert sum(p["output_tokens_per_s"] for p in series) == pytest.approx(25)


def _engine_stats() -> EngineStats:
    return EngineStats(
        device_blocks=PoolStats(total=100, used=40, free=50, cached=10),
        host_blocks=PoolStats(total=30, used=6, free=24, cached=0),
        block_size=16,
        num_running=5,
        num_waiting=2,
        num_swapped=1,
        live_tokens=600,
        payload_bytes=6000,
        allocated_bytes=6400,
        shared_bytes=0,
        preemptions_total={"recompute": 3, "swap": 4},
        blocks_swapped_out_total=12,
        blocks_swapped_in_total=8,
        prefix_cache_queries_total=900,
        prefix_cache_hits_total=300,
        prompt_tokens_total=900,
        generation_tokens_total=450,
        steps_total=77,
    )


def test_parses_every_series_from_kvserve_metrics() -> None:
    """The scrape table names exactly what server/metrics.py exports."""
    metrics = ServerMetrics(model_name="m", stats_fn=_engine_stats, cache_info={})
    text = metrics.render()[0].decode()
    values = parse_metrics(text)
    assert values == {
        "kv_usage_ratio": 0.4,
        "kv_blocks_used": 40,
        "kv_blocks_cached": 10,
        "kv_blocks_capacity": 100,
        "host_blocks_used": 6,
        "kv_payload_bytes": 6000,
        "kv_allocated_bytes": 6400,
        "num_running": 5,
        "num_waiting": 2,
        "num_swapped": 1,
        "preemptions_total": 7,
        "blocks_swapped_out_total": 12,
        "blocks_swapped_in_total": 8,
        "prefix_cache_queries_total": 900,
        "prefix_cache_hits_total": 300,
        "generation_tokens_total": 450,
    }
    assert set(values) == {m.key for m in METRICS}


def test_parses_vllm_names_and_leaves_absent_series_out() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 3\n'
    )
    assert parse_metrics(text) == {"kv_usage_ratio": 0.25, "num_running": 3}


def _run_result(with_metrics: bool) -> RunResult:
    records = [_record(0.0, 0.3, [0.05] * 10), _record(0.5, 0.4, [0.06] * 10)]
    samples = [
        {
            "t": 0.0,
            "kv_usage_ratio": 0.1,
            "num_running": 1,
            "num_waiting": 0,
            "preemptions_total": 2,
            "blocks_swapped_out_total": 0,
        },
        {
            "t": 1.0,
            "kv_usage_ratio": 0.7,
            "num_running": 2,
            "num_waiting": 1,
            "preemptions_total": 5,
            "blocks_swapped_out_total": 4,
        },
    ]
    return RunResult(
        config=LoadTestConfig(concurrency=2, turns=1, api_key="k"),
        model="m",
        started_at="2026-01-01T00:00:00+00:00",
        duration_s=1.5,
        stopped_by="completed",
        records=records,
        metric_samples=samples if with_metrics else [],
        metrics_available=with_metrics,
    )


@pytest.mark.parametrize("with_metrics", [True, False])
def test_report_files(tmp_path: Path, with_metrics: bool) -> None:
    document = build_result(_run_result(with_metrics))
    assert "api_key" not in document["config"]
    assert document["config"]["user_len"] == "64"
    if with_metrics:
        assert document["server_metrics"]["increase"] == {
            "preemptions_total": 3,
            "blocks_swapped_out_total": 4,
        }
        assert document["server_metrics"]["peak"]["kv_usage_ratio"] == 0.7
    assert len(document["requests"]) == 2 and document["requests"][0]["ttft"] == 0.3
    png = tmp_path / "report.png"
    plot_report(document, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = format_summary(document)
    assert "2 ok, 0 failed" in text and "ttft" in text
    assert ("preemptions_total 3" in text) == with_metrics


def test_progress_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBar(total=10, stream=stream, width=10, log_every_s=0.0)
    bar.update(done=5, errors=1, out_tokens=200, elapsed=2.0)
    bar.close(done=10, errors=1, out_tokens=400, elapsed=4.0)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[#####.....] 5/10 req") and "100.0 out tok/s" in lines[0]
    assert lines[1].startswith("[##########] 10/10 req") and "errors 1" in lines[1]
    silent = io.StringIO()
    ProgressBar(total=1, stream=silent, enabled=False).update(1, 0, 1, 1.0)
    assert silent.getvalue() == ""


def test_only_counters_end_in_total() -> None:
    counters = {m.key for m in METRICS if m.key.endswith("_total")}
    assert counters == {
        "preemptions_total",
        "blocks_swapped_out_total",
        "blocks_swapped_in_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "generation_tokens_total",
    }
    assert all(name.endswith("_total") for m in METRICS if m.key in counters for name in m.names)
