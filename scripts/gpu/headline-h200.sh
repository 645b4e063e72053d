#!/usr/bin/env bash
# Issue 59's H200 headline, one scenario and one piece per call, so that each piece fits one
# session's device time and every piece is restartable (run it again with the same RUN_DIR:
# measured grid points and study trials are kept, a cut gate goes on after its whole rounds).
#
# Scenarios (dummy weights of ../shared/gpu/models shapes, real arrivals):
#   conv         Llama-3.1-8B shape, Azure 2023 conversation trace as recorded, TTFT p95 <= 1000 ms,
#                TPOT p95 <= 25 ms (issue 58's scenario)
#   code         Llama-3.1-8B shape, Azure 2023 code trace as recorded (prompts p50 ~1.5k tokens,
#                bursty), TTFT p95 <= 500 ms, TPOT p95 <= 50 ms
#   translation  Qwen2-1.5B shape, translation-length traffic at 200 req/s (the sample trace's
#                shape, seeded), TTFT p95 <= 500 ms, TPOT p95 <= 50 ms, stock `vllm serve` with 4
#                API processes (one front end cannot offer this rate: results/h100-2026-11-23)
# Pieces:
#   grid    max_num_seqs x max_num_batched_tokens x quantization {none, fp8} (every power of two
#           between an axis' ends: the search replay samples the grid), 8-16 points with
#           vLLM's defaults among them, one launch each on the tuning window `autotune run`
#           searches; then the defaults twice more (RUN_DIR/grid-repeat-K, RUN_DIR/grid/repeats.json)
#           so the table carries their noise. ~1.5-2 min a point on an H200: MAX_POINTS=N stops
#           after N new points (resume in the next session); QUANTIZATION=none measures the
#           default weights' half first (conv, code: 8 points), a later QUANTIZATION=none,fp8 run extends
#           that table with the fp8 half, keeping what was measured.
#   tuned   `autotune run`, default space, the hand-tuned config (16 seqs / 8192 / 0.3) as
#           --compare, 3 trials, gate of 3 interleaved held-out repeats (~20 min)
#   fp8     the same with `--allow fp8` (~20 min)
# Run from a copy of the checkout outside the one the device tool re-sends, in the background:
#   (setsid nohup bash scripts/gpu/headline-h200.sh conv grid /root/kit /root/runs/conv > /root/h.out 2>&1 &)
#   bash scripts/gpu/poll.sh /root/runs/conv 500
# Then, where the run folders were brought back: python3 benchmarks/headline_table.py
#   --grid RUN_DIR/grid --tuned RUN_DIR/tuned --fp8 RUN_DIR/fp8 --out RUN_DIR/table.md
# Usage: headline-h200.sh SCENARIO PIECE KIT_DIR RUN_DIR   (env MAX_POINTS, QUANTIZATION, TRIALS)
set -euo pipefail
usage="usage: headline-h200.sh conv|code|translation grid|tuned|fp8 KIT_DIR RUN_DIR"
[ $# -eq 4 ] || { echo "headline-h200.sh: 4 arguments, not $#; $usage" >&2; exit 2; }
scenario=$1; piece=$2; kit=$3; run=$4
# Every argument checked before any work (a trace conversion costs a device call's seconds).
case "$scenario" in conv|code|translation) ;; *) echo "headline-h200.sh: scenario '$scenario': not conv, code or translation; $usage" >&2; exit 2 ;; esac
case "$piece" in grid|tuned|fp8) ;; *) echo "headline-h200.sh: piece '$piece': not grid, tuned or fp8; $usage" >&2; exit 2 ;; esac
[ -d "$kit/models" ] || { echo "headline-h200.sh: KIT_DIR $kit: no models/ folder (the offline kit, or ../shared/gpu)" >&2; exit 2; }
source scripts/gpu/env.sh
mkdir -p "$run"
case "$scenario" in
  conv)
    model=llama3.1-8b-shape; context=8192; slos=(ttft_p95_ms=1000 tpot_p95_ms=25)
    seqs=512,1024; batched=1024,2048,4096,8192; server=()
    [ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_conv_2023.csv" "$run/traffic.jsonl" ;;
  # max_num_seqs only at vLLM's 1024: outputs p50 13 tokens keep few sequences running, and
  # 512 read the same as 1024 at every chunk budget (results/h200-2026-11-25, 8-point grid),
  # so the points go to the chunk budget and fp8, the levers of a prefill-bound scenario.
  code)
    model=llama3.1-8b-shape; context=8192; slos=(ttft_p95_ms=500 tpot_p95_ms=50)
    seqs=1024; batched=1024,2048,4096,8192; server=()
    [ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_code_2023.csv" "$run/traffic.jsonl" ;;
  # On an H100 this traffic kept 256-476 sequences running (results/h100-2026-11-24/small-model,
  # num_running_max): 256 and 512 tell whether the cap binds. Chunk budgets 4096 (the H100 run's
  # best) and vLLM's 8192 only: 12 points at ~2.3 min (that run's trials) with the repeats fit
  # two device sessions, where 2048 too made 18. (Each axis holds every power of two between
  # its ends: the search replay samples the grid.)
  translation)
    model=qwen2-1.5b-shape; context=4096; slos=(ttft_p95_ms=500 tpot_p95_ms=50)
    seqs=256,512,1024; batched=4096,8192; server=(--server vllm --api-server-count 4 --step-requests 1000)
    [ -f "$run/traffic.jsonl" ] || python3 -m autotune generate "$run/traffic.jsonl" --duration-s 300 --rate 200 --seed 7 ;;
esac
common=(--model "$kit/models/$model" --load-format dummy --max-model-len "$context" --over-context drop
  --slo "${slos[0]}" --slo "${slos[1]}" --objective capacity --tuning-window 60 --holdout-window 60 "${server[@]}")
case "$piece" in
  grid)
    measure=(python3 benchmarks/search_efficiency.py measure --objective capacity --trace "$run/traffic.jsonl"
      --seqs "$seqs" --batched "$batched" --quantization "${QUANTIZATION:-none,fp8}")
    for flag in "${common[@]}"; do measure+=("--run-arg=$flag"); done
    printf '%q ' "${measure[@]}" > "$run/grid-command.txt"; echo >> "$run/grid-command.txt"
    { date -u +"grid start %FT%TZ"
      "${measure[@]}" --table "$run/grid" ${MAX_POINTS:+--max-points "$MAX_POINTS"}
      for k in 1 2; do  # vLLM's defaults twice more: the table's noise (once: a rerun would add a point)
        [ -f "$run/grid-repeat-$k/table.json" ] || "${measure[@]}" --table "$run/grid-repeat-$k" --max-points 1
      done
      printf '{"tables": ["../grid-repeat-1", "../grid-repeat-2"], "note": "vLLM defaults measured again on the same host, same traffic"}\n' > "$run/grid/repeats.json"
      date -u +"grid end %FT%TZ"; } >> "$run/grid.log" 2>&1 ;;
  tuned|fp8)
    study=h200-$scenario-$piece; out=$run/$piece
    allow=(); [ "$piece" = fp8 ] && allow=(--allow fp8)
    resume=(); [ -f "$out/study.db" ] && resume=(--resume)
    cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" "${common[@]}" "${allow[@]}"
      --compare scripts/gpu/handtuned.yaml --trials "${TRIALS:-3}" --top-k 1 --repeats 3
      --study-name "$study" --output-dir "$out" --seed 0 "${resume[@]}")
    printf '%q ' "${cmd[@]}" > "$run/$piece-command.txt"; echo >> "$run/$piece-command.txt"
    { date -u +"$piece start %FT%TZ"; "${cmd[@]}" || echo "exit $?"; date -u +"$piece end %FT%TZ"; } \
      >> "$run/$piece.log" 2>&1 < /dev/null ;;
esac
