"""`search_efficiency.py replay`'s results: every table replayed (benchmarks/search_replay.py),
the issue's goals and the method's notes, written to results/benchmarks/search_efficiency.{json,md}
with the markdown report of each grid."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from benchmarks.benchlib import Goal, Recorder, fmt, md_table, say
from benchmarks.search_replay import COST_GOAL, DONE_TARGET, SEARCH_ONLY, TARGETS, replay_table
from benchmarks.search_table import QUANTIZATION_AXIS, grid_quantizations, load_table, relative_dir


def figures(grid: dict[str, Any]) -> dict[str, Any]:
    """A table's replay as the JSON keeps it: its figures, without the copy of the measured points
    (the table's own table.json) and each seed's launch order (a replay gives them again)."""
    strategies = {name: {k: v for k, v in result.items() if k != "launched"}
                  for name, result in grid["strategies"].items()}
    return {k: v for k, v in grid.items() if k != "table"} | {"strategies": strategies}


def replay(args: argparse.Namespace) -> int:
    from autotune.request import DEFAULT_TRIALS

    recorder = Recorder("search_efficiency", "Search efficiency: our tuner vs plain TPE, random search "
                        "and the grid, on measured grids (issue 18)", "quick" if args.quick else "full",
                        out_dir=args.out)
    seeds = list(range(args.seeds))
    grids: dict[str, Any] = {}
    for table_dir in args.tables:
        say(f"replaying {table_dir}")
        grids[relative_dir(Path(table_dir))] = replay_table(load_table(Path(table_dir)), Path(table_dir), seeds,
                                                               DEFAULT_TRIALS, as_one=args.as_one)
    goals = []
    for name, grid in grids.items():
        done = grid["done_when"]
        goals.append(Goal(
            name=f"{name} ({grid['objective']}): ours, share of the grid's cost spent until the best "
                 f"reaches {DONE_TARGET:g}x the grid's best (median over {len(seeds)} seeds)",
            target=f"<= {COST_GOAL:g}",
            measured=done["median_share"],
            met=done["median_met"],
            note="" if done["median_share"] is not None else "more than half the seeds never reach it",
        ))
        goals.append(Goal(
            name=f"{name} ({grid['objective']}): seeds of ours reaching {DONE_TARGET:g}x within "
                 f"{COST_GOAL:.0%} of the grid's cost",
            target=f">= {done['seeds_needed']}/{len(seeds)}",
            measured=done["seeds_within"],
            met=done["seeds_met"],
        ))
    notes = [
        "Tabular benchmark: every grid point was measured once for real (`measure`: the CPU "
        "tables on this machine's CPU engine, benchmarks/data/h100-*/*/grid and benchmarks/data/h200*/*/grid on lent H100s and H200s); the strategies were then REPLAYED over the measured table: each trial gets "
        "the measured outcome of its point (for capacity, the whole ladder: the first moves read "
        "the baseline's ladder as they would live) and is charged that point's measured wall-clock "
        "cost (engine start, warm-up, ladder or window, teardown) on a virtual clock. No engine ran "
        "during the replay. The 'GPU-seconds' of the issue are these engine wall-seconds (on CPU, "
        "the CPU engine's).",
        f"Ours = autotune.search.study.TuningStudy as `autotune run` builds it with its defaults: "
        f"--trials {DEFAULT_TRIALS} (the baseline included), the objective and SLOs the table was "
        f"measured with (capacity: the default objective; CPU SLOs, or the GPU table's own), seeds 0-{len(seeds) - 1} "
        f"(`--seed N`; 0 is the default). The search space is the grid itself (each knob every power "
        f"of two from its lowest to its highest grid value): `autotune run`'s default space is "
        f"wider than any measured grid. The gate is not replayed.",
        "First moves (autotune.search.first_moves) need a capacity ladder: on the goodput table they "
        "never fire, and ours is plain TPE there.",
        "Plain TPE = the same study without the first moves (baseline first, then TPE). Random = "
        "every grid point once in a seeded random order. Grid order = every point in auto_tune.sh's "
        "nested-loop order (max_num_seqs outer); it is the same every seed.",
        "A table without repeats: each point was measured once, a re-proposed point is charged again "
        "and returns the same measurement (a live run would measure it again, with noise), and the "
        "grid's best is the best single measurement. A table with repeats (TABLE/repeats.json: "
        "other tables measuring some of its configs again, same trace, window, SLOs and ladder) is "
        "replayed POOLED: every launch of a config answers with one of its recorded launches, drawn "
        "at random (seeded) each time, and is charged that launch's cost; a point's value is the "
        "median of its launches (its cost their mean), so the grid's best is the best median; a "
        "strategy's result after each launch is the median of the config it would pick then (its "
        "best launch so far). That is the noise a live tuner faces, judged by the best estimate "
        "of what each config carries.",
        "Capacity tables: the baseline's ladder started at 1x; every other point's at the baseline's "
        "capacity (finer steps), as `autotune run` starts a trial at the best capacity so far; a live "
        "trial started from a better best would take a few more or fewer steps than charged here.",
        "Grid cost = the sum of every grid point's measured cost (measuring every point once, as "
        "vLLM's benchmarks/auto_tune/auto_tune.sh does). When vLLM's defaults are a grid point, "
        "the baseline is that point.",
        "Median share over all seeds: a seed that never reaches the target counts as infinite.",
        "The H100 and H200 grids of the long-prompt scenario (results/h100-2026-11-23c/long-prompts, "
        "results/h200-2026-11-25/long-prompts) were measured first with 8 points (max_num_seqs "
        "512-1024 x batched 1024-8192), where the baseline's launch alone cost 0.17-0.18 of the grid "
        "and no strategy that measures vLLM's defaults first could meet the 0.25; both were then "
        "extended to 19 points (each section's 'Measured in parts'). On all three long-prompt grids "
        "no ladder step of any point ran more than 19 requests at once, so a max_num_seqs of 128 or "
        "more never bound: along that axis the points differ by launch-to-launch spread. Two repeats "
        "of the four sequence counts at 1024 batched tokens on an H100 "
        "(results/h100-2026-11-23c/long-prompts/seqs-repeats-2026-11-26) reshuffled their order "
        "(256 sequences, a best point of that grid at 14.0, measured 13.2 and 14.0; 512, at 13.2 in "
        "the grid, 14.0 and 14.8), and a second launch of 1024/1024 on 2026-11-23 (grid-repeat) "
        "measured 10.6 against the grid's 13.2. Two more repeats on another H100 on 2026-11-27 "
        "(results/h100-2026-11-23c/long-prompts/seqs-repeats-2026-11-27) measured the four counts at "
        "10.3-14.0: over their 21 launches every count spans at least 2.3 req/s (17%), wider than "
        "the one ladder step (6%) between the per-config medians the goal tells apart.",
        "Judged as one scheduler config (the line under each done-when): grid points at one batched "
        "budget whose max_num_seqs never bound (in every ladder step of every launch at most half the "
        "cap ran at once, nothing was preempted, the KV cache stayed under 90%) made the decisions "
        "vLLM's scheduler makes with no cap, so their launches are pooled into one value and a "
        "launch of any of them draws from all of them.",
        "The CPU capacity grid was measured on this shared 2-core machine, where the replayer and the "
        "engine share the cores with other work: every ladder step's client ran late (send-lag p99 in "
        "the grid's section) and TTFT broke first at every point. Launches of one config vary by far "
        "more than the 10% goal (results/benchmarks/capacity_repeats.md), so differences between the "
        "points with 8 or more sequences are mostly measurement noise, and the grid's best is a tie "
        "of single measurements at the same ladder step.",
        "The 19-point grid of the same scenario "
        "(results/h200-x4-2026-11-26/long-prompts, max_num_seqs 128-1024 x max_num_batched_tokens "
        "512-8192) was measured on the four H200s of one host at once (`measure --shard K/N`, "
        "scripts/gpu/grid-8b-gpus.sh): the baseline first on GPU 0 alone, then one shard per GPU, "
        "each point's engine with a GPU and 16 of the 64 CPUs to itself and a copy of the "
        "baseline's compile cache; the other shards' engines ran beside almost every point. Where "
        "it overlaps the one-GPU H200 grid of 2026-11-25 (7 points besides the baseline), 4 points "
        "came out one ladder step (about 5%) higher and 3 the same.",
    ]
    result = recorder.result(
        settings={"seeds": len(seeds), "targets": list(TARGETS), "cost_goal": COST_GOAL,
                  "default_trials": DEFAULT_TRIALS, "tables": list(grids)},
        goals=goals,
        results={"grids": {name: figures(grid) for name, grid in grids.items()}},
        notes=notes,
    )
    recorder.write(result, tables(grids, len(seeds)))
    for name, grid in grids.items():
        done = grid["done_when"]
        say(f"{name}: done-when {'met' if done['met'] else 'NOT met'} (median share "
            f"{fmt(done['median_share'])}, {done['seeds_within']}/{len(seeds)} seeds within {COST_GOAL:.0%})")
    return 0


def tables(grids: dict[str, Any], seeds: int) -> str:
    lines: list[str] = []
    for name, grid in grids.items():
        settings = grid["settings"]
        objective = grid["objective"]
        lines += [f"## `{name}`: {objective} grid", ""]
        if objective == "capacity":
            ladder = settings["ladder"]
            lines += [
                f"Measured as {settings['measured_as']}. Tuning window: {settings['window_requests']} "
                f"requests of `{settings['trace']}` ({settings['window_recorded_s']:.0f} s recorded, "
                f"{settings['recorded_rps']:.2f} req/s); SLOs {', '.join(settings['slos'])}; ladder "
                f"{ladder['step_requests']} requests and >= {ladder['min_step_s']:g} s a step, growth "
                f"x{ladder['growth']:g}, resolution {ladder['resolution']:.0%}.", "",
                "Capacity req/s (cost s, ladder steps, the SLO that broke first):", ""]
        else:
            lines += [
                f"Window: {settings['window_requests']} requests of `{settings['trace']}` "
                f"({settings['window_recorded_s']:g} s, {settings['window_rate_rps']:.1f} req/s), goodput "
                f"under {', '.join(settings['slos'])}. Measured with the older goodput objective; "
                f"kept and replayed for comparison (vLLM's defaults are already 0.97x of its best, and "
                f"the first moves need a ladder).", "",
                "Goodput req/s (* = misses an SLO or failed; cost s):", ""]
        points = {(p["effective"]["max_num_seqs"], p["effective"]["max_num_batched_tokens"], p.get("quantization")): p
                  for p in grid["table"]}
        batched = sorted(settings["grid"]["max_num_batched_tokens"])
        rows = []
        # A grid with a quantization axis: the fp8 rows under those with vLLM's default weights.
        for q, s in itertools.product(grid_quantizations(settings["grid"]), sorted(settings["grid"]["max_num_seqs"])):
            row = [f"max_num_seqs {s}" + (f", {q}" if q else "")]
            for b in batched:
                p = points.get((s, b, q))
                row.append("-" if p is None else cell(p))
            rows.append(row)
        lines += md_table(["", *[f"batched {b}" for b in batched]], rows)
        base = grid["baseline"]
        g = grid["grid"]
        if base:
            where = "a grid point" if g["baseline_in_grid"] else "not a grid point"
            lines += ["", f"Baseline (vLLM's defaults: max_num_seqs {base['effective']['max_num_seqs']}, "
                          f"max_num_batched_tokens {base['effective']['max_num_batched_tokens']}; {where}): "
                          f"{cell(base)}, {base['score'] / g['best_score']:.2f}x the grid's best."]
        ties = [p["label"] for p in grid["table"] if p["feasible"] and p["score"] >= g["best_score"]]
        lines += ["", f"Grid: {g['points']} points, {g['feasible_points']} feasible, best {g['best_score']:.3g} "
                      f"req/s ({', '.join(ties)}), cost {g['cost_s']:.0f} s ({g['cost_s'] / 60:.1f} min)."]
        if "best_by_quantization" in g:
            lines += ["", quantization_bests(g["best_by_quantization"], g["best_score"])]
        for group in grid.get("scheduler_classes") or []:
            weights = f", {group['quantization']}" if group.get("quantization") else ""
            lines += ["", f"**One scheduler config:** {', '.join(group['labels'])} (batched {group['batched']}{weights}): in "
                          f"every ladder step of their {group['launches']} launches at most half of the point's own "
                          f"cap ran at once (the most: {group['peak_running']:g}; the smallest cap "
                          f"{group['smallest_cap']}), nothing was preempted and the KV cache stayed under 90%; "
                          f"judged as one config, its value is the median of all {group['launches']} launches, "
                          f"{group['score']:.3g} req/s, and a launch of one of them draws from all of them"
                          + ("." if grid.get("judged_as_one") else
                             " (the line after the done-when; the tables judge each point on its own launches).")]
        for earlier in grid["settings"].get("extended", []):
            later = sorted(p["measured_at"] for p in grid["table"] if p["measured_at"] > earlier["last_measured_at"])
            lines += ["", f"Measured in parts: {earlier['points']} points on the grid {axes(earlier['grid'])} "
                          f"until {earlier['last_measured_at']}; the grid was then extended and "
                          f"{len(later)} points measured, the first done at {later[0] if later else '-'} (the table takes points "
                          "only with the same model, trace window, SLOs and ladder; the baseline was not "
                          "measured again: the new points' ladders start at its capacity)."]
        load, lag = grid["conditions"]["load_1min_before"], grid["conditions"]["send_lag_p99_ms"]
        others = grid["conditions"]["other_engine_share"]
        lines += ["", f"While it was measured: load average (1 min) before a point {span(load, '{:.1f}')} "
                      f"on the measuring host"
                  + (f"; the replayer's send-lag p99 per ladder step {span(lag, '{:.0f}')} ms" if lag["n"] else "")
                  + (f"; another vLLM engine ran on the host for {span(others, '{:.2f}')} of a point's time "
                     "(other work, or the other shards of a grid measured on several GPUs at once)"
                     if others["n"] and others["max"] > 0 else "")
                  + ".", ""]
        least = grid.get("least_share_baseline_first")
        if least is not None:
            lines += [f"The least any search that measures the baseline first can spend to reach {DONE_TARGET:g}x "
                      f"(the baseline, then straight to the cheapest point that reaches it): **{least:.3f}** of "
                      f"the grid's cost"
                      + (f", over the goal's {COST_GOAL:g}: no such search can meet the goal on this grid."
                         if least > COST_GOAL else "."), ""]
        apart = grid.get("launches_to_tell_apart")
        if apart is not None:
            lines += [f"Telling the grid's best ({g['best_score']:.3g} req/s) from the best point under "
                      f"{DONE_TARGET:g}x it ({apart['below']:.3g}, {apart['gap']:.2g} req/s apart) takes "
                      f"**{apart['launches_per_config']} launches of each** (for their means to order them right "
                      f"9 times in 10): one config's "
                      f"launches spread by {apart['pooled_sd']:.2g} req/s (SD within a config, pooled over "
                      f"the {apart['configs']} configs launched more than once, {apart['launches']} launches"
                      + (f"; {apart['scheduler_configs']} of them several grid points that ran as one scheduler config"
                         if apart.get("scheduler_configs") else "") + "). "
                      "With one launch each, any search tells them apart only by chance.", ""]
        if base and base["feasible"] and base["score"] >= DONE_TARGET * g["best_score"]:
            lines += [f"**vLLM's defaults alone reach {DONE_TARGET:g}x the grid's best** "
                      f"({base['score'] / g['best_score']:.2f}x): every strategy that measures the baseline "
                      f"first meets the target on its first launch, so this grid does not tell the searches "
                      f"apart; the rows marked '{SEARCH_ONLY.strip(' -')}' show what each search found "
                      f"beyond the defaults.", ""]
        for target in TARGETS:
            lines += [f"### To reach {target:g}x the grid's best ({target * g['best_score']:.3g} req/s); "
                      f"median (min-max) over {seeds} seeds", ""]
            rows = []
            for strategy, data in grid["strategies"].items():
                at = data[f"{target:g}"]
                rows.append([
                    strategy,
                    f"{at['seeds_reaching']}/{seeds}",
                    span(at["launches"], "{:g}"),
                    span(at["seconds"], "{:.0f}"),
                    span(at["share_of_grid_cost"], "{:.2f}"),
                    "never" if at["median_share_all_seeds"] is None else f"{at['median_share_all_seeds']:.2f}",
                    f"{at['seeds_within_cost_goal']}/{seeds}",
                ])
            lines += md_table(["strategy", "seeds reaching it", "launches", "seconds", "share of grid cost",
                               "median share, all seeds", f"seeds within {COST_GOAL:.0%} of grid cost"], rows)
            lines.append("")
        lines += ["### Each strategy's whole run", ""]
        rows = [[strategy, span(data["launches"], "{:g}"), span(data["repeated_launches"], "{:g}"),
                 span(data["cost_share"], "{:.2f}"), span(data["final_over_best"], "{:.3f}")]
                for strategy, data in grid["strategies"].items()]
        lines += md_table(["strategy", "launches", "of them a point measured before", "cost / grid cost",
                           "final best / grid best"], rows)
        done = grid["done_when"]
        median = "never" if done["median_share"] is None else f"{done['median_share']:.2f}"
        lines += ["", f"Done-when ({grid['ours']}): median share of the grid's cost to reach {DONE_TARGET:g}x = "
                      f"{median} "
                      f"(goal <= {COST_GOAL:g}); {done['seeds_within']}/{seeds} seeds within {COST_GOAL:.0%} "
                      f"(goal >= {done['seeds_needed']}): **{'met' if done['met'] else 'not met'}**.", ""]
        other = grid.get("done_when_judged_otherwise")
        if other:
            median = "never" if other["median_share"] is None else f"{other['median_share']:.2f}"
            lines += [f"The same done-when for ours, judged {other['judge']} (the grid's best "
                      f"{other['grid_best']:.3g} req/s): median share {median}, {other['seeds_within']}/{seeds} "
                      f"seeds within {COST_GOAL:.0%}: **{'met' if other['met'] else 'not met'}**.", ""]
    return "\n".join(lines)


def axes(grid: dict[str, list[Any]]) -> str:
    """A grid's axes as the report names them: max_num_seqs 512-1024 x batched 1024-8192
    (x quantization none, fp8)."""
    return " x ".join(f"{k} {', '.join(v)}" if k == QUANTIZATION_AXIS else
                      f"{'batched' if k == 'max_num_batched_tokens' else k} {min(v)}-{max(v)}"
                      for k, v in grid.items())


def quantization_bests(bests: dict[str, Any], grid_best: float) -> str:
    """The summary line of a grid with fp8 points: its best without fp8 and with it."""
    def best(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "no point met the SLOs"
        return f"**{entry['score']:.3g} req/s** ({entry['point']}, {entry['score'] / grid_best:.2f}x the grid's best)"

    without, with_fp8 = bests["none"], bests["fp8"]
    ratio = (f"; fp8's best is {with_fp8['score'] / without['score']:.2f}x the best without"
             if without and with_fp8 and without["score"] > 0 else "")
    return (f"Grid's best without fp8 (vLLM's default weights): {best(without)}; with fp8 weights "
            f"(`quantization: fp8`, changes numerics): {best(with_fp8)}{ratio}. The done-when is judged "
            "against the grid's overall best.")


def cell(point: dict[str, Any]) -> str:
    if len(point.get("launches") or []) > 1:
        return (f"{point['score']:.3g}, median of {len(point['launches'])} launches "
                f"({', '.join(format(p['score'], '.3g') for p in point['launches'])}; mean {point['wall_s']:.0f} s)")
    if point.get("capacity_rps") is not None or point.get("ladder_steps") is not None:
        mark = "" if point["ok"] else f" {point['failure']}"
        return (f"{point['score']:.3g}{mark} ({point['wall_s']:.0f} s, {point['ladder_steps']} steps, "
                f"{point['limiting_slo'] or '-'})")
    return f"{point['score']:.2f}{'' if point['feasible'] else '*'} ({point['wall_s']:.0f})"


def span(stats: dict[str, Any], form: str) -> str:
    if stats["median"] is None:
        return "-"
    return f"{form.format(stats['median'])} ({form.format(stats['min'])}-{form.format(stats['max'])})"
