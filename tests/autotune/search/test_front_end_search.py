"""The front-end process count as a searched parameter (`api_processes` in a --space file):
the real CLI in its own process, every trial server a fake that carries more with more
front ends (one slot behind one front end, eight behind two), so the count decides capacity;
on our server (the count in each trial's config.yaml) and on `vllm serve` (`--server vllm`:
the count as its `--api-server-count`). Plus the refusals a user can cause, each one line and
exit 2, before any trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.cli import main
from autotune.measure.server_start import IPC_ENV
from server.config import ServerConfig

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
ROOT = HELPERS.parents[1]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
TUNER = HELPERS / "fake_server_tuner.py"
SPACE = "extend_defaults: false\nparams:\n  api_processes: {type: int, low: 1, high: 2}\n"
# Goodput (one replay of the window per trial) rather than the capacity ladder: what is under
# test is the count's way from the space to the servers and best.yaml, not the objective.
# The seeded sampler's first proposal after the baseline is the other count.
ARGS = ["--workload", SAMPLE, "--objective", "goodput", "--trials", "2", "--tuning-window", "8",
        "--holdout-window", "6", "--top-k", "1", "--repeats", "1",
        "--slo", "ttft_p50_ms=1000", "--slo", "tpot_p50_ms=100", "--study-name", "fronts"]


@pytest.fixture(scope="module", params=["autotune", "vllm"])
def tuned(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], str]:
    server = request.param
    tmp_path = tmp_path_factory.mktemp(f"front-ends-{server}")
    behaviour, space, out = tmp_path / "behaviour.json", tmp_path / "space.yaml", tmp_path / "out"
    behaviour.write_text(json.dumps({"front_end_slots": [[1, 1], [2, 8]], "token_delay_s": 0.005,
                                     "ipc_socket": True}))
    space.write_text(SPACE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop(IPC_ENV, None)  # as a user's shell has it: the tuner picks the folder
    done = subprocess.run([sys.executable, str(TUNER), str(behaviour), "run", *ARGS, "--space", str(space),
                           "--output-dir", str(out), "--server", server],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    return out, done, server


def trial_processes(out: Path) -> dict[str, int]:
    """Each trial's front-end count, as its config.yaml gave it to the server."""
    counts = {}
    for path in sorted((out / "trials").glob("trial-*/config.yaml")):
        counts[path.parent.name] = ServerConfig.load(path).serving.api_processes
    return counts


@pytest.mark.slow
def test_the_searched_front_end_count_reaches_the_servers_and_the_exported_config(tuned) -> None:
    out, done, server = tuned
    assert done.returncode == 0, done.stderr[-3000:]
    counts = trial_processes(out)
    assert counts["trial-0000"] == 1  # the baseline: the server's default
    assert set(counts.values()) == {1, 2}, counts
    # Every trial server started with the count its config.yaml says; `vllm serve` as its flag
    # (left out at one, vLLM's own default), since the file it reads has engine arguments only.
    for name, count in counts.items():
        log = (out / "trials" / name / "server.log").read_text()
        assert f"fake server: {count} front-end processes" in log
        command = log.splitlines()[0]
        if server == "vllm":
            assert "vllm-serve.yaml" in command
            assert ("--api-server-count 2" in command) == (count == 2), command
            outcome = json.loads((out / "trials" / name / "outcome.json").read_text())
            assert outcome["server"] == f"vllm serve{' --api-server-count 2' if count == 2 else ''} (stock vLLM)"
    # Two front ends meet the SLOs here and one does not: the exported config keeps two, where both
    # our server and `vllm serve` read it (our section; no engine argument of that name).
    best_path = out / "best.yaml"
    best = yaml.safe_load(best_path.read_text())
    assert best["additional-config"]["vllm_autotune"]["serving"]["api_processes"] == 2
    assert not {"api_processes", "api-processes"} & set(best)
    assert ServerConfig.load(best_path).serving.api_processes == 2
    # Every server's IPC sockets went to a folder of the run's own, removed at its end.
    sockets = [line.split("ipc socket ", 1)[1] for name in counts
               for line in (out / "trials" / name / "server.log").read_text().splitlines() if "ipc socket " in line]
    assert len(sockets) == len(counts)
    folders = {Path(path).parent for path in sockets}
    assert len(folders) == 1 and next(iter(folders)).name.startswith("autotune-ipc-"), folders
    assert not next(iter(folders)).exists()
    # The header tells a `vllm serve` user the flag the file cannot carry to it, and names the
    # server the winner was measured on as it ran (our server reads the count from the file).
    assert "vllm serve --config best.yaml --api-server-count 2" in best_path.read_text()
    measured_on = {"vllm": "vllm serve --api-server-count 2 (stock vLLM)",
                   "autotune": "python -m server (vllm-autotune's server)"}[server]
    assert f"# measured on: {measured_on}\n" in best_path.read_text()
    report = (out / "report.md").read_text()
    assert "Changed serving settings: `api_processes=2`" in report
    assert "`vllm serve --config best.yaml --api-server-count 2`" in report


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, space: str, *args: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(space)
    code = main(["run", "--workload", SAMPLE, "--space", str(path), "--output-dir", str(tmp_path / "out"),
                 "--tuning-window", "8", "--holdout-window", "6", "--slo", "ttft_p50_ms=1000", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert not (tmp_path / "out" / "trials").exists()
    return err.removeprefix("autotune: error: ")


@pytest.mark.slow
def test_a_front_end_count_that_is_not_a_whole_number_from_one_is_refused(tmp_path: Path, capsys) -> None:
    err = refused(capsys, tmp_path, "params:\n  api_processes: {type: float, low: 0.5, high: 2}\n")
    assert err == (f"{tmp_path / 'space.yaml'}: field 'params.api_processes' = float 0.5..2.0: a count of "
                   "processes: type int or pow2 with low >= 1, or whole-number choices >= 1")


def test_a_searched_front_end_count_beside_a_fixed_one_is_refused(tmp_path: Path, capsys) -> None:
    err = refused(capsys, tmp_path, SPACE, "--api-server-count", "2")
    assert err == (f"{tmp_path / 'space.yaml'}: params.api_processes: --api-server-count 2 fixes the "
                   "count the space searches; drop one of the two")


def test_a_searched_front_end_count_with_a_recording_baseline_is_refused(tmp_path: Path, capsys) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(
        "additional-config:\n  vllm_autotune:\n    serving:\n      recorder:\n"
        f"        directory: {tmp_path / 'recorded'}\n"
    )
    err = refused(capsys, tmp_path, SPACE, "--baseline", str(baseline))
    assert err.startswith(f"{tmp_path / 'space.yaml'}: params.api_processes: ")
    assert err.endswith("records traffic (serving.recorder), which needs one front-end process; drop the "
                        "recorder from the baseline for tuning, or the parameter")
