"""Reading vLLM's per-iteration log lines, launch beside launch (benchmarks/engine_iterations.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from benchmarks import engine_iterations as bench

# The two layouts as vLLM writes them: 0.24 (the GPU kit) logs from the engine core's process,
# 0.32 (the CPU build) from the front end's stat logger, with the KV cache after the time.
LINE_024 = ("(EngineCore pid=2025) INFO 11-29 01:36:{s:02d} [core.py:452] Iteration({i}): {c} context "
            "requests, {ct} context tokens, {g} generation requests, {g} generation tokens, "
            "iteration elapsed time: 0.03 ms")
LINE_032 = ("(MainProcess pid=20768) INFO 11-29 01:45:{s:02d} [loggers.py:199] Engine 000: Iteration({i}): "
            "{c} context requests, {ct} context tokens, {g} generation requests, {g} generation "
            "tokens, iteration elapsed time: 0.11 ms, CPU KV cache usage: 0.0%")


def write_log(path: Path, line: str, per_second: list[tuple[int, int]]) -> Path:
    """A log with, per second, `iterations` decode-only iterations of batch `batch`, plus one
    prefill iteration and a line that is not an iteration."""
    rows, index = ["INFO starting the engine"], 0
    for second, (iterations, batch) in enumerate(per_second):
        rows.append(line.format(s=second, i=index, c=1, ct=512, g=batch))
        index += 1
        for _ in range(iterations - 1):
            rows.append(line.format(s=second, i=index, c=0, ct=0, g=batch))
            index += 1
    text = "\n".join(rows) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_both_vllm_layouts_are_read_plain_or_gzipped(tmp_path: Path) -> None:
    old = bench.Iterations(write_log(tmp_path / "a.log.gz", LINE_024, [(20, 40), (30, 40)]))
    new = bench.Iterations(write_log(tmp_path / "b.log", LINE_032, [(20, 40)]))
    assert len(old) == 50 and len(new) == 20
    assert list(old.decode_only(33, 64)) == [0.03] * 48
    assert old.ctx_tokens.sum() == 2 * 512


def test_the_report_sets_iterations_per_second_side_by_side_at_equal_batch(tmp_path: Path) -> None:
    # One launch iterates half as often at a batch of 40 as the other, and only it reached 300.
    fast = write_log(tmp_path / "fast.log", LINE_024, [(200, 40), (200, 40)])
    slow = write_log(tmp_path / "slow.log", LINE_024, [(100, 40), (100, 40), (30, 300)])
    text = bench.report([bench.Iterations(fast), bench.Iterations(slow)], ["fast", "slow"])
    decode_only, per_second = text.split("Iterations per second")
    assert "| 33-64 | 0.03 / 0.03 (398) | 0.03 / 0.03 (198) |" in decode_only
    assert "| 33-64 | 200 (2) | 100 (2) |" in per_second
    assert "| 257-512 | - | 30 (1) |" in per_second


def test_a_log_without_iteration_lines_is_a_one_line_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "server.log"
    empty.write_text("INFO nothing to see\n")
    with pytest.raises(SystemExit) as exit_:
        bench.main([str(empty)])
    assert exit_.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "enable_logging_iteration_details" in message
