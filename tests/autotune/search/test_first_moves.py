"""The search's first phase: which one-knob moves the baseline's ladder points to."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from autotune.decide.report import trial_rows, validation_section
from autotune.measure.ladder import CapacityResult, LadderStep
from autotune.measure.limits import limiting_slo
from autotune.measure.scraper import ServerMetrics
from autotune.measure.trial import TrialOutcome
from autotune.search.first_moves import first_moves, memory_descent
from autotune.search.objective import Objective, parse_objective
from autotune.search.relations import parse_relation
from autotune.search.space import ParamSpec, SearchSpace
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from server.config import ServerConfig
from tests.factories import ladder_step, trial_outcome
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

SLOS = [parse_slo("ttft_p95_ms=500"), parse_slo("tpot_p95_ms=50")]
SPACE = SearchSpace({
    "max_num_seqs": ParamSpec(type="int", low=8, high=1024, log=True),
    "max_num_batched_tokens": ParamSpec(type="pow2", low=1024, high=16384),
    "gpu_memory_utilization": ParamSpec(type="float", low=0.3, high=0.92),
}, [])
DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}


def step(speedup: float, passed: bool, ttft: float, tpot: float, *, waiting: float = 0,
         running: float = 10, engine_ttft: float | None = None) -> LadderStep:
    return ladder_step(speedup=speedup, offered_rps=speedup, requests=100, passed=passed,
                       measured_ms={"ttft_p95_ms=500": ttft, "tpot_p95_ms=50": tpot},
                       server=ServerMetrics(num_waiting_max=waiting, num_running_max=running,
                                            ttft_p95_ms=engine_ttft))


def capacity(*steps: LadderStep) -> CapacityResult:
    return CapacityResult(capacity_rps=1, capacity_speedup=1, recorded_rps=1, first_fail_rps=2,
                          bracketed=True, steps=list(steps))


def test_decode_stalls_shrink_the_prefill_budget_first() -> None:
    """The H100 long-prompt probe: TPOT broke first at 8192 batched tokens; 2048 carried 1.67x.
    The first move the tuner makes is exactly that quarter of the budget."""
    measured = capacity(step(1, True, 200, 40), step(2, False, 450, 76))
    assert limiting_slo(measured, SLOS) == "tpot"
    moves = first_moves(measured, SLOS, SPACE, DEFAULTS)
    assert [m.values["max_num_batched_tokens"] for m in moves[:2]] == [2048, 4096]
    assert moves[2].values["max_num_seqs"] == 512
    for move in moves:  # one knob at a time, the rest as the baseline
        changed = {k for k, v in move.values.items() if v != DEFAULTS[k]}
        assert len(changed) == 1


def test_a_queue_behind_a_full_batch_asks_for_more_sequences() -> None:
    small = {**DEFAULTS, "max_num_seqs": 16}
    measured = capacity(step(1, True, 300, 20, waiting=40, running=16), step(2, False, 2000, 22))
    moves = first_moves(measured, SLOS, SPACE, small)
    assert [m.values["max_num_seqs"] for m in moves[:2]] == [32, 64]


def test_moves_stay_inside_the_space_and_are_never_the_baseline() -> None:
    at_floor = {**DEFAULTS, "max_num_batched_tokens": 1024}
    measured = capacity(step(1, True, 200, 40), step(2, False, 300, 90))
    moves = first_moves(measured, SLOS, SPACE, at_floor)
    assert all(m.values != at_floor for m in moves)
    assert all(1024 <= m.values["max_num_batched_tokens"] <= 16384 for m in moves)
    assert first_moves(None, SLOS, SPACE, DEFAULTS) == []


def test_a_front_end_that_fell_behind_asks_for_more_front_ends_first() -> None:
    """The H200 held-out step of one `vllm serve` API process: TTFT p95 1,402 ms at the client,
    vLLM's own ~460 ms (within the 500 ms SLO), TPOT 16 ms, nothing waiting in the engine."""
    fronts = SearchSpace({**SPACE.params, "api_processes": ParamSpec(type="int", low=1, high=4)}, [])
    base = {**DEFAULTS, "api_processes": 1}
    lagging = capacity(step(128, True, 113, 10, engine_ttft=90), step(193, False, 1402, 16, engine_ttft=460))
    moves = first_moves(lagging, SLOS, fronts, base)
    assert [m.values["api_processes"] for m in moves[:2]] == [2, 4]
    assert "front end fell behind" in moves[0].why and "1402 ms at the client, 460 by vLLM" in moves[0].why
    # Numeric choices, as scripts/gpu/space-front-ends.yaml has them.
    choices = SearchSpace({"api_processes": ParamSpec(type="categorical", choices=[1, 2, 4])}, [])
    assert [m.values for m in first_moves(lagging, SLOS, choices, {"api_processes": 1})] == [
        {"api_processes": 2}, {"api_processes": 4}]
    # TTFT over the SLO inside vLLM too, or requests waiting in its engine: the engine's knobs.
    for engine_bound in (capacity(step(128, True, 113, 10, engine_ttft=90), step(193, False, 700, 16, engine_ttft=660)),
                         capacity(step(128, True, 113, 10, engine_ttft=90),
                                  step(193, False, 1402, 16, engine_ttft=460, waiting=30))):
        assert all(m.knob != "api_processes" for m in first_moves(engine_bound, SLOS, fronts, base))
    # Without the knob in the space, nothing changes.
    assert all(m.knob != "api_processes" for m in first_moves(lagging, SLOS, SPACE, DEFAULTS))


# -- the study's first phase, with a fake runner whose capacity peaks at 1024 batched tokens --


WINDOW = Trace.from_requests(
    [TraceRequest(timestamp=i * 100.0, input_length=50, output_length=20) for i in range(100)])


class FakeRunner:
    """A trial runner whose launches only record the config and answer `measure(config)`'s
    capacity ladder (kept in the trial folder, where the first phase reads the baseline's)."""

    def __init__(self, measure: Callable[[ServerConfig], CapacityResult]) -> None:
        self.measure = measure
        self.configs: list[ServerConfig] = []

    def run(self, config: ServerConfig, window: Trace, trial_dir: Path, *, should_prune=None,
            start_speedup=None, **_: object) -> TrialOutcome:
        trial_dir.mkdir(parents=True, exist_ok=True)
        self.configs.append(config)
        result = self.measure(config)
        (trial_dir / "ladder.json").write_text(result.model_dump_json())
        return trial_outcome(trial_dir, capacity=result)


def search(tmp_path: Path, runner: FakeRunner, space: SearchSpace, n_trials: int, *,
           objective: Objective | None = None, baseline: ServerConfig | None = None,
           baseline_source: str = "defaults", say: Callable[[str], None] = lambda line: None) -> TuningStudy:
    study = TuningStudy(
        options=StudyOptions(study_name="moves", output_dir=tmp_path, n_trials=n_trials, top_k=1, repeats=1),
        inputs=SearchInputs(
            space=space, objective=objective or Objective(kind="capacity"), slos=SLOS,
            baseline=baseline or ServerConfig(engine={"model": "fake"}), baseline_source=baseline_source,
            tuning_window=WINDOW, holdout_window=WINDOW, effective_defaults=DEFAULTS),
        runner=runner, say=say,
    )
    study.run_search()
    return study


def run_ladder_study(tmp_path: Path, space: SearchSpace, n_trials: int) -> tuple[list[tuple[int, int]], TuningStudy]:
    """A study over a fake runner whose capacity peaks at 512 sequences and 1024 batched
    tokens; TPOT is what breaks (as on the H100). Returns the (seqs, batched) launched and the study."""

    def knobs(config: ServerConfig) -> tuple[int, int]:
        return int(config.engine.get("max_num_seqs") or 1024), int(config.engine.get("max_num_batched_tokens") or 8192)

    def measure(config: ServerConfig) -> CapacityResult:
        seqs, batched = knobs(config)
        rps = 10.0 - 2.0 * abs(math.log2(batched / 1024)) - 1.0 * abs(math.log2(seqs / 512))
        result = capacity(step(rps / 10, True, 200, 45), step(rps / 10 * 1.1, False, 300, 60))
        return result.model_copy(update={"capacity_rps": rps, "recorded_rps": 10.0})

    runner = FakeRunner(measure)
    study = search(tmp_path, runner, space, n_trials)
    return [knobs(config) for config in runner.configs], study


def test_the_study_follows_the_move_that_paid_off_then_moves_the_next_knob_from_the_best(tmp_path) -> None:
    launched, study = run_ladder_study(tmp_path, SPACE, n_trials=5)
    header, rows = trial_rows(study.study, Objective(kind="capacity"))
    assert {row[header.index("broke first")] for row in rows} == {"tpot"}
    # Baseline 8192; a quarter (2048) paid off, so one step further (1024). The budget's floor
    # ends that line and half the budget (the same direction) is not tried again; half the
    # sequences then starts from the best so far (1024 batched), not from the baseline, and
    # pays off too, so one step further (256).
    assert launched == [(1024, 8192), (1024, 2048), (1024, 1024), (512, 1024), (256, 1024)]
    best = study.gate.best_trials(study.study, 1)[0]
    assert best.user_attrs["capacity_rps"] == 10.0
    assert best.user_attrs["engine_params"]["max_num_seqs"] == 512


def test_a_chunk_budget_move_that_tied_is_followed_once_and_a_sequence_cap_that_tied_is_not(tmp_path) -> None:
    """The H200 conversation grid with fp8: 2048-8192 batched tokens all carry 32 req/s at the
    ladder's resolution, 1024 carries 36; the sequence cap, never reached, changes nothing."""

    def measure(config: ServerConfig) -> CapacityResult:
        batched = int(config.engine.get("max_num_batched_tokens") or 8192)
        rps = 36.0 if batched == 1024 else 32.0 if batched >= 2048 else 20.0
        result = capacity(step(rps / 10, True, 200, 20), step(rps / 10 * 1.1, False, 300, 60))
        return result.model_copy(update={"capacity_rps": rps, "recorded_rps": 10.0})

    runner, said = FakeRunner(measure), []
    study = search(tmp_path, runner, SPACE, n_trials=5, say=said.append)
    launched = [(int(c.engine.get("max_num_seqs") or 1024), int(c.engine.get("max_num_batched_tokens") or 8192))
                for c in runner.configs]
    # 2048 ties the baseline: one step further, 1024 (the space's floor), pays off. Half the
    # sequences from the best then ties, and is not followed to 256: TPE proposes next.
    assert launched[:4] == [(1024, 8192), (1024, 2048), (1024, 1024), (512, 1024)], launched
    assert launched[4][0] != 256, launched
    assert any("(max_num_batched_tokens=2048) tied with the best: next" in line for line in said), said
    best = study.gate.best_trials(study.study, 1)[0]
    assert best.user_attrs["capacity_rps"] == 36.0


def test_a_move_vllm_would_refuse_is_skipped_without_spending_a_trial(tmp_path) -> None:
    # With 512 batched tokens in the space, following 1024 -> 512 at 1024 sequences breaks
    # "max_num_batched_tokens >= max_num_seqs": it is skipped, not launched or counted.
    space = SearchSpace({**SPACE.params, "max_num_batched_tokens": ParamSpec(type="pow2", low=512, high=16384)},
                        [parse_relation("max_num_batched_tokens >= max_num_seqs")])
    launched, study = run_ladder_study(tmp_path, space, n_trials=4)
    assert launched == [(1024, 8192), (1024, 2048), (1024, 1024), (512, 1024)]
    assert len(study.study.trials) == 4 and not any(t.user_attrs.get("broken_relations") for t in study.study.trials)


def test_a_study_whose_front_end_fell_behind_tries_more_front_ends_first(tmp_path) -> None:
    """One front end lags (TTFT at the client far over vLLM's own); two carry more; four more
    still: the first phase goes 1 -> 2, which paid off, -> 4, before TPE."""

    def measure(config: ServerConfig) -> CapacityResult:
        rps = {1: 100.0, 2: 150.0, 4: 200.0}[config.serving.api_processes]
        result = capacity(step(rps / 10, True, 200, 20, engine_ttft=150),
                          step(rps / 10 * 1.1, False, 1400, 20, engine_ttft=450))
        return result.model_copy(update={"capacity_rps": rps, "recorded_rps": 10.0})

    runner, said = FakeRunner(measure), []
    space = SearchSpace({"api_processes": ParamSpec(type="categorical", choices=[1, 2, 4])}, [])
    study = search(tmp_path, runner, space, n_trials=3, say=said.append)
    assert [config.serving.api_processes for config in runner.configs] == [1, 2, 4]
    assert any("api_processes=2" in line and "front end fell behind" in line for line in said), said
    assert any("above it ttft (outside the engine) broke first" in line for line in said), said
    # The report's trial table says where each config broke, and so does its validation table.
    header, rows = trial_rows(study.study, Objective(kind="capacity"))
    assert {row[header.index("broke first")] for row in rows} == {"ttft (outside the engine)"}
    result = study.validate(study.study)
    assert {m.broke_first for m in result.measurements} == {"ttft (outside the engine)"}
    table = validation_section(SimpleNamespace(
        decision=result.decision, measurements=result.measurements,
        objective=Objective(kind="capacity"), slos=SLOS))
    assert "broke first |" in table[0] and all(
        line.endswith("| ttft (outside the engine) |") for line in table[2:len(result.decision.stats) + 2])


# -- min-memory: bisecting memory ----------------------------------------------------------


def test_memory_descent_bisects_between_the_least_memory_that_met_and_the_most_that_missed() -> None:
    space = SearchSpace({"gpu_memory_utilization": ParamSpec(type="float", low=0.1, high=0.3)}, [])
    base = {"gpu_memory_utilization": 0.3}
    assert memory_descent([(0.3, True)], space, base).values["gpu_memory_utilization"] == 0.2
    assert memory_descent([(0.3, True), (0.2, False)], space, base).values["gpu_memory_utilization"] == 0.25
    assert memory_descent([(0.3, True), (0.2, True)], space, base).values["gpu_memory_utilization"] == 0.15
    # Within the resolution (0.02 without a step): done; a baseline that missed: nothing to descend.
    assert memory_descent([(0.3, True), (0.2, False), (0.21, True)], space, base) is None
    assert memory_descent([(0.3, False)], space, base) is None
    # Near the space's bound, the bound itself once, then done.
    assert memory_descent([(0.11, True)], space, base).values["gpu_memory_utilization"] == 0.1
    assert memory_descent([(0.11, True), (0.1, True)], space, base) is None
    # On a stepped grid the target is rounded up to it (less than the grid has is not a config).
    stepped = SearchSpace({"gpu_memory_utilization": ParamSpec(type="float", low=0.05, high=0.95, step=0.05)}, [])
    move = memory_descent([(0.9, True), (0.45, False)], stepped, {"gpu_memory_utilization": 0.9})
    assert move.values["gpu_memory_utilization"] == 0.7  # (0.45 + 0.9) / 2 = 0.675 -> 0.7


def test_a_min_memory_study_bisects_memory_to_the_least_that_meets_the_slos(tmp_path) -> None:

    def measure(config: ServerConfig) -> CapacityResult:
        """Every SLO holds at the headroom from 0.17 of the memory up (the weights need the rest)."""
        passed = float(config.engine["gpu_memory_utilization"]) >= 0.17
        result = capacity(step(1.5, passed, 200 if passed else 900, 20))
        return result.model_copy(update={"capacity_rps": 15.0 if passed else 0.0, "recorded_rps": 10.0,
                                         "capacity_speedup": 1.5 if passed else None})

    runner = FakeRunner(measure)
    space = SearchSpace({
        "max_num_seqs": ParamSpec(type="int", low=8, high=1024, log=True),
        "gpu_memory_utilization": ParamSpec(type="float", low=0.1, high=0.3),
    }, [])
    study = search(tmp_path, runner, space, n_trials=6,
                   objective=parse_objective("min-memory", SLOS, headroom=1.5),
                   baseline=ServerConfig(engine={"model": "fake", "gpu_memory_utilization": 0.3}),
                   baseline_source="deployed.yaml")
    memory = [float(config.engine["gpu_memory_utilization"]) for config in runner.configs]
    # 0.3 met; 0.2 met; 0.15 missed; 0.18 met; 0.17 met (within 0.02 of 0.15's miss: done); then TPE.
    assert memory[:5] == [0.3, 0.2, 0.15, 0.18, 0.17]
    best = study.gate.best_trials(study.study, 1)[0]
    assert best.values == [0.17]


# -- a first move changes the knob it names and nothing else (issue 58) -----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autotune.search.numerics import NUMERICS_NOTE, numerics_params  # noqa: E402

LIMITS = {  # what the baseline's ladder showed -> its (passing, failing) steps
    "tpot": (step(1, True, 200, 40), step(2, False, 300, 90)),
    "ttft, full batch": (step(1, True, 300, 20, waiting=40, running=4096), step(2, False, 2000, 22)),
    "ttft": (step(1, True, 300, 20), step(2, False, 2000, 22)),
}


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.integers(1, 4096),
    batched=st.one_of(st.sampled_from([512, 2048, 8192, 16384]), st.integers(64, 65536)),
    memory=st.floats(0.05, 0.98),
    accelerator=st.sampled_from(["gpu", "cpu"]),
    limit=st.sampled_from(sorted(LIMITS)),
    fp8=st.booleans(),
)
def test_a_first_move_never_changes_a_knob_it_does_not_name(
    seqs: int, batched: int, memory: float, accelerator: str, limit: str, fp8: bool
) -> None:
    """On the H200 the baseline's 1024 sequences were clamped into 1-32: both moves ran with
    32 sequences, TTFT broke from queueing, and the gate kept the baseline. Here: the config
    the move's trial really runs (enqueued, asked of Optuna, suggested) is the baseline's with
    one knob changed, whatever the baseline, with or without the fp8 knobs in the space."""
    resolved = {"max_num_seqs": seqs, "max_num_batched_tokens": batched, "gpu_memory_utilization": memory}
    space = SearchSpace.default(accelerator, baseline=resolved)  # type: ignore[arg-type]
    # What the baseline's trial records (engine_params): every space knob, None where vLLM's default.
    baseline = {**resolved, **{name: None for name in numerics_params(["fp8"] if fp8 else [], {})}}
    space = space.extended(numerics_params(["fp8"] if fp8 else [], baseline))
    moves = first_moves(capacity(*LIMITS[limit]), SLOS, space, baseline)  # none: at the space's edge
    study = optuna.create_study()
    for move in moves:
        study.enqueue_trial(space.fixed_params(move.values))
        ran = space.suggest(study.ask())
        changed = {name for name in space.params if ran[name] != baseline[name]}
        assert changed == {move.knob}, (move.name, ran)


def test_with_the_fp8_opt_in_the_first_phase_reaches_fp8_and_a_smaller_chunk_budget(tmp_path) -> None:
    """The H200 figures (Llama-3.1-8B shape, Azure conversation traffic, TPOT breaking first):
    defaults 20.5 req/s, 1024 batched tokens alone 21.7, fp8 weights 28.9, fp8 + 1024 batched
    36.2. fp8 goes first, and the chunk-budget moves then start from it: the interaction is
    found in four launches, the baseline's included, every one marked as changing numerics."""
    alone = {8192: 1.0, 4096: 1.0, 2048: 1.0, 1024: 1.06, 512: 0.9}
    with_fp8 = {8192: 1.41, 4096: 1.45, 2048: 1.6, 1024: 1.77, 512: 1.5}

    def knobs(config: ServerConfig) -> tuple[str | None, int]:
        return config.engine.get("quantization"), int(config.engine.get("max_num_batched_tokens") or 8192)

    def measure(config: ServerConfig) -> CapacityResult:
        quantization, batched = knobs(config)
        rps = 20.5 * (with_fp8 if quantization == "fp8" else alone)[batched]
        result = capacity(step(rps / 10, True, 200, 45), step(rps / 10 * 1.1, False, 300, 60))  # TPOT breaks
        return result.model_copy(update={"capacity_rps": rps, "recorded_rps": 10.0})

    space = SearchSpace.default("gpu", baseline=DEFAULTS)
    space = space.extended(numerics_params(["fp8"], {}))
    runner = FakeRunner(measure)
    lines: list[str] = []
    study = search(tmp_path, runner, space, n_trials=4, say=lines.append)
    launched = [knobs(config) for config in runner.configs]
    assert launched == [(None, 8192), ("fp8", 8192), ("fp8", 2048), ("fp8", 1024)]
    assert all(config.engine.get("kv_cache_dtype") is None for config in runner.configs)  # never named
    best = study.gate.best_trials(study.study, 1)[0]
    assert best.user_attrs["capacity_rps"] == pytest.approx(36.3, abs=0.1)
    assert best.user_attrs["changes_numerics"] == {"quantization": "fp8"}
    assert sum(NUMERICS_NOTE in line for line in lines) == 3  # each fp8 trial's live line
    # A knob left to vLLM's default is not a setting of the trial (the H200 run printed
    # `kv_cache_dtype=None` beside each fp8 trial's values).
    assert not any("=None" in line for line in lines)


def test_the_eta_prices_what_is_left_at_the_hinted_trials_not_the_cold_first_one(tmp_path) -> None:
    """The first trial climbs its ladder from 1x, cold; every later trial and gate run starts
    at a capacity measured before (the CPU demo: 137 s, then 36 and 57 s, gate runs ~40 s).
    Here the first costs 100 s on the study's clock and each hinted run 10 s."""
    clock = SimpleNamespace(now=0.0)

    class TimedRunner(FakeRunner):
        def run(self, config, window, trial_dir, *, should_prune=None, start_speedup=None, **_):
            clock.now += 100.0 if start_speedup is None else 10.0
            return super().run(config, window, trial_dir, should_prune=should_prune, start_speedup=start_speedup)

    def measure(config: ServerConfig) -> CapacityResult:
        rps = 10.0 if config.engine.get("max_num_batched_tokens") is None else 9.0
        result = capacity(step(rps / 10, True, 200, 45), step(rps / 10 * 1.1, False, 300, 60))
        return result.model_copy(update={"capacity_rps": rps, "recorded_rps": 10.0})

    lines: list[str] = []
    study = TuningStudy(
        options=StudyOptions(study_name="eta", output_dir=tmp_path, n_trials=3, top_k=1, repeats=1),
        inputs=SearchInputs(
            space=SPACE, objective=Objective(kind="capacity"), slos=SLOS,
            baseline=ServerConfig(engine={"model": "fake"}), baseline_source="defaults",
            tuning_window=WINDOW, holdout_window=WINDOW, effective_defaults=DEFAULTS),
        runner=TimedRunner(measure), say=lines.append, clock=lambda: clock.now,
    )
    study.run_search()
    etas = [line.split("ETA ")[1].split()[0] for line in lines if line.startswith("trial ")]
    # After the first: 2 trials + 2 gate runs at its 100 s; then at the hinted 10 s each.
    assert etas == ["6m40s", "30s", "20s"]
