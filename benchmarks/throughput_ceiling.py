"""The engine's saturated throughput on a trace window: the ceiling no config's capacity can pass.

Capacity (the highest rate at which every SLO holds) can never exceed the rate at which the
engine finishes the same requests when it gets them all at once and no SLO applies. This
benchmark measures that rate in-process (vLLM's offline `LLM.generate`, token-id prompts with
the window's recorded lengths, outputs forced with `ignore_eos`), for each chunked-prefill
budget asked, so a capacity target can be checked against what the GPU can do at all.

    python3 benchmarks/throughput_ceiling.py --trace traffic.jsonl --model MODEL_DIR \
        --max-model-len 8192 --batched 8192,2048 --out ceiling.json

The window is the held-out window `autotune run --tuning-window T --holdout-window H` gates on
(the same `select_windows`). Each budget is one engine in a fresh process (vLLM frees GPU
memory only when its process ends). Writes --out (JSON) atomically and prints one line per
budget.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from workloads.errors import OneLineErrorParser
from workloads.files import write_text_atomic
from workloads.trace_io import load_trace
from workloads.windows import select_windows


def measure(model: str, max_model_len: int, batched: int, seqs: int, memory: float,
            inputs: list[int], outputs: list[int], queue: Any) -> None:
    """One engine, every request submitted at once; puts the figures on `queue`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=max_model_len, max_num_batched_tokens=batched, max_num_seqs=seqs,
              gpu_memory_utilization=memory, enable_prefix_caching=False)
    start_s = time.monotonic() - started
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompts(offset: int) -> list[TokensPrompt]:
        # Distinct token ids per request so nothing is shared between prompts.
        return [TokensPrompt(prompt_token_ids=[(offset + 7919 * i + j) % (vocab - 1) + 1
                                               for j in range(n)])
                for i, n in enumerate(inputs)]

    params = [SamplingParams(max_tokens=o, ignore_eos=True, detokenize=False, temperature=0.0)
              for o in outputs]
    llm.generate(prompts(1)[:16], params[:16], use_tqdm=False)  # warm-up
    began = time.monotonic()
    results = llm.generate(prompts(100_003), params, use_tqdm=False)
    wall = time.monotonic() - began
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    queue.put({"max_num_batched_tokens": batched, "max_num_seqs": seqs,
               "gpu_memory_utilization": memory, "engine_start_s": round(start_s, 1),
               "requests": len(inputs), "wall_s": round(wall, 2),
               "requests_per_s": round(len(inputs) / wall, 2),
               "prompt_tokens_per_s": round(sum(inputs) / wall),
               "output_tokens_per_s": round(produced / wall),
               "output_tokens": produced})


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--batched", default="8192", help="comma-separated budgets")
    parser.add_argument("--seqs", type=int, default=1024)
    parser.add_argument("--memory", type=float, default=0.92)
    parser.add_argument("--tuning-window", type=float, default=60.0)
    parser.add_argument("--holdout-window", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    trace = load_trace(args.trace)
    _, holdout, info = select_windows(trace, args.tuning_window, args.holdout_window)
    inputs = [int(n) for n in holdout.input_lengths]
    outputs = [int(n) for n in holdout.output_lengths]
    recorded = len(holdout) / holdout.duration_s()
    print(f"held-out window: {len(holdout)} requests, {recorded:.2f} req/s recorded, "
          f"prompt mean {sum(inputs) / len(inputs):.0f} tokens, output mean "
          f"{sum(outputs) / len(outputs):.1f}", flush=True)
    runs = []
    context = multiprocessing.get_context("spawn")
    for batched in (int(b) for b in args.batched.split(",")):
        queue = context.Queue()
        child = context.Process(target=measure, args=(
            args.model, args.max_model_len, batched, args.seqs, args.memory, inputs, outputs,
            queue))
        child.start()
        child.join()
        if child.exitcode != 0:
            print(f"batched {batched}: engine process exited {child.exitcode}", flush=True)
            continue
        run = queue.get()
        runs.append(run)
        print(f"batched {batched}: {run['requests_per_s']} req/s saturated "
              f"({run['prompt_tokens_per_s']} prompt tok/s, {run['wall_s']} s for "
              f"{run['requests']} requests; {run['requests_per_s'] / recorded:.2f}x the "
              f"recorded rate)", flush=True)
    document = {"command": " ".join([sys.executable, *sys.argv]), "trace": args.trace,
                "model": args.model, "window": {"requests": len(holdout),
                "recorded_rate": round(recorded, 3), "prompt_tokens": sum(inputs),
                "output_tokens": sum(outputs), "start_s": info.holdout.start_s}, "runs": runs}
    write_text_atomic(Path(args.out), json.dumps(document, indent=2))
    return 0 if runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
