"""A shared fork server's socket, refused in one line where it cannot be used (no vLLM import:
the fork server itself is tested in test_forkserver.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.cli.flags import FORK_SERVER_SOCKET_ENV
from autotune.measure.forkserver import ForkServerSocketError, claim_socket_path

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"


def one_line_refusal(capsys: pytest.CaptureFixture[str], *args: str | Path) -> str:
    code = main([*map(str, args)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("autotune: error: ") and "\n" not in err, err
    return err


def test_a_tuner_pointed_at_a_socket_nobody_listens_on_is_refused_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    sock = tmp_path / "nobody.sock"
    err = one_line_refusal(capsys, "run", "--workload", SAMPLE, "--output-dir", out, "--fork-server-socket", sock)
    assert f"fork server socket {sock}: nobody listens there" in err
    assert "autotune fork-server --socket PATH" in err  # the fix
    assert not out.exists()
    monkeypatch.setenv(FORK_SERVER_SOCKET_ENV, str(sock))  # the same from the environment
    err = one_line_refusal(capsys, "run", "--workload", SAMPLE, "--output-dir", out)
    assert f"fork server socket {sock}: nobody listens there" in err


def test_a_socket_path_that_is_taken_is_refused_and_a_stale_one_replaced(tmp_path: Path) -> None:
    listening = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(listening))
        live.listen(1)
        with pytest.raises(ForkServerSocketError, match="a fork server already listens there"):
            claim_socket_path(listening)
    assert listening.exists()  # closed, not removed: what a fork server killed leaves
    claim_socket_path(listening)
    assert not listening.exists()
    regular = tmp_path / "notes.txt"
    regular.write_text("mine")
    with pytest.raises(ForkServerSocketError, match="the path exists and is not a socket"):
        claim_socket_path(regular)
    assert regular.read_text() == "mine"
    with pytest.raises(ForkServerSocketError, match="its folder does not exist"):
        claim_socket_path(tmp_path / "missing" / "x.sock")


def test_the_fork_server_command_refuses_a_path_it_cannot_listen_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    regular = tmp_path / "notes.txt"
    regular.write_text("mine")
    err = one_line_refusal(capsys, "fork-server", "--socket", regular)
    assert f"fork server socket {regular}: the path exists and is not a socket" in err
    assert regular.read_text() == "mine"


@pytest.mark.parametrize("command", ["worker", "finalize"])
def test_a_worker_pointed_at_a_socket_nobody_listens_on_is_refused_before_it_connects(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "study.db"
    sock = tmp_path / "nobody.sock"
    err = one_line_refusal(capsys, command, "--storage", f"sqlite:///{database}", "--study", "s",
                           "--output-dir", tmp_path / "out", "--fork-server-socket", sock)
    assert f"fork server socket {sock}: nobody listens there" in err
    assert not database.exists()  # the study's database not even opened
