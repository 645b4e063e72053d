"""A stand-in for `python -m server` whose behaviour the test chooses (for launcher tests).

Usage: python fake_server.py [--behaviour B.json] --config FILE --port P [--benchmark-mode]
The behaviour is read from --behaviour if given, else from --config (then a JSON file).
Keys (all optional):
  ready_after_s   seconds until /health answers 200; null = never (default 0)
  exit_after_s    exit this many seconds after start, printing `message`, code `exit_code`
  exit_code       default 1; -9 = die by SIGKILL (as from the OOM killer)
  message         a line printed to stderr before exiting
  spawn_child     start a `sleep` child in the same process group (default false)
  ignore_sigterm  ignore SIGTERM in the server and its child (default false)
  metrics_file    path whose text /metrics returns
  token_delay_s   POST /v1/completions streams `max_tokens` tokens this far apart (0.01)
  fail_every      answer every n-th completion with HTTP 500
  die_after       exit (printing `message`) once this many completions were answered
  allocate_mib    hold this much touched memory while running
  slots           serve at most this many completions at once, the rest wait in line (a
                  server with a known capacity: slots / (max_tokens * token_delay_s) req/s);
                  /metrics then reports live vllm:num_requests_running / _waiting gauges
  memory_slots    [[MEMORY, SLOTS], ...]: `slots` from the config's gpu_memory_utilization,
                  the pair with the highest MEMORY at or under it (a config that carries more
                  with more memory); the start log then has vLLM 0.32 CPU's KV cache lines,
                  scaled to the memory
  ipc_socket true: binds a unix socket in VLLM_RPC_BASE_PATH (else the temp folder), as vLLM
                  does, and logs its path
  front_end_slots [[PROCESSES, SLOTS], ...]: `slots` from the front-end count (`--api-server-count`,
                  as `vllm serve` takes it, else the config's serving.api_processes),
                  likewise (a server whose front ends limit what it carries)
  front_s         every completion first waits its turn in one line (first come, first served)
                  and takes this long there, outside the gauges: a front end's event loop that
                  parses and tokenizes each request before the engine sees it, for clients that
                  went away too; one whose client is gone by then ends there (as vLLM's front
                  end finds out when it gets to the request)
  topology        {"tp_speedup": S}: a server on the config's tensor_parallel_size T x
                  data_parallel_size D GPUs (either spelling, 1 when unset): every token comes
                  S**log2(T) times sooner (one engine split across T GPUs), and `slots` is D
                  times as many (D replicas); the start log says "fake server: topology TxD"
  prefix_cache    true: /metrics also has vLLM's prefix-cache counters,
                  vllm:prefix_cache_queries_total and _hits_total (prompt tokens), one per
                  data-parallel engine (requests go to the engines in turn): a prompt's leading
                  16-token blocks that engine saw before are hits, as vLLM's cache finds them
GET /stats answers {"completions": n}: the completions received so far (for tests that act
once the measured window is under way).
"""

from __future__ import annotations

import argparse
import http.server
import json
import math
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--benchmark-mode", action="store_true")
    parser.add_argument("--behaviour")
    # As `vllm serve` takes them (--server vllm): the count overrides the file's.
    parser.add_argument("--host")
    parser.add_argument("--api-server-count", type=int)
    args = parser.parse_args()
    with open(args.behaviour or args.config) as handle:
        behaviour = json.load(handle)
    started = time.monotonic()
    print(f"fake server pid starting on port {args.port}", flush=True)

    if behaviour.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour.get("spawn_child"):
        child_code = "import time\nwhile True: time.sleep(1)"
        if behaviour.get("ignore_sigterm"):
            child_code = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + child_code
        child = subprocess.Popen([sys.executable, "-c", child_code])
        print(f"child pid {child.pid}", flush=True)

    ballast = bytearray(behaviour.get("allocate_mib", 0) * 2**20)
    pages = -(-len(ballast) // 4096)
    ballast[::4096] = b"\x01" * pages  # touch every page so it is really resident, in one C loop
    ready_after = behaviour.get("ready_after_s", 0)
    metrics_file = behaviour.get("metrics_file")
    token_delay = behaviour.get("token_delay_s", 0.01)
    fail_every = behaviour.get("fail_every")
    die_after = behaviour.get("die_after")
    completions = {"n": 0}
    lock = threading.Lock()
    slots = behaviour.get("slots")
    if behaviour.get("memory_slots"):
        memory = config_memory(args.config)
        slots = slots_at(behaviour["memory_slots"], memory + 1e-9)
        # The lines vLLM 0.32's CPU backend logs at start (copied from a real server.log).
        kv_gib, tokens = round(memory * 2.3, 2), int(memory * 1_209_600)
        print(f"(Worker pid=4999) INFO 11-24 07:43:17 [cpu_worker.py:260] Auto set ({kv_gib}/9.09) GiB "
              f"for KV cache on node 0, with {memory * 9.1:.2f} GiB requested memory for the worker. "
              "0.68 GiB memory was consumed by non-kv usages.", flush=True)
        print(f"(EngineCore pid=4935) INFO 11-24 07:43:17 [kv_cache_utils.py:2327] CPU KV cache size: "
              f"{tokens:,} tokens, Maximum concurrency for 2,048 tokens per request: 59.06x", flush=True)
    if behaviour.get("ipc_socket"):
        # As vLLM binds its engine connections (and, killed, leaves the file behind).
        import tempfile
        import uuid

        ipc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir(), str(uuid.uuid4()))
        ipc.bind(path)
        print(f"fake server: ipc socket {path}", flush=True)
    if behaviour.get("front_end_slots"):
        processes = args.api_server_count or config_api_processes(args.config)
        slots = slots_at(behaviour["front_end_slots"], processes)
        print(f"fake server: {processes} front-end processes, {slots} slots", flush=True)
    engines = 1
    if behaviour.get("topology"):
        tp = int(config_engine_value(args.config, "tensor_parallel_size", 1))
        engines = int(config_engine_value(args.config, "data_parallel_size", 1))
        token_delay /= float(behaviour["topology"].get("tp_speedup", 1.0)) ** math.log2(tp)
        slots = (slots or 1) * engines
        print(f"fake server: topology {tp}x{engines}, {slots} slots", flush=True)
    prefix = {"queries": [0] * engines, "hits": [0] * engines, "seen": [set() for _ in range(engines)]}
    gate = threading.Semaphore(slots) if slots else None
    front_s = behaviour.get("front_s")
    front_line: queue.Queue[threading.Event] = queue.Queue()

    def front_end() -> None:
        while True:
            turn = front_line.get()
            time.sleep(front_s)
            turn.set()

    if front_s:
        threading.Thread(target=front_end, daemon=True).start()
    gauges = {"running": 0, "waiting": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
            if self.path == "/health":
                up = ready_after is not None and time.monotonic() - started >= ready_after
                self._answer(200 if up else 503, b"")
            elif self.path == "/metrics" and gate is not None:
                with lock:
                    text = (f"vllm:num_requests_running {gauges['running']}\n"
                            f"vllm:num_requests_waiting {gauges['waiting']}\n")
                    if behaviour.get("prefix_cache"):
                        for engine in range(engines):
                            text += (f'vllm:prefix_cache_queries_total{{engine="{engine}"}} {prefix["queries"][engine]}\n'
                                     f'vllm:prefix_cache_hits_total{{engine="{engine}"}} {prefix["hits"][engine]}\n')
                self._answer(200, text.encode())
            elif self.path == "/stats":
                with lock:
                    self._answer(200, json.dumps({"completions": completions["n"]}).encode())
            elif self.path == "/metrics" and metrics_file:
                with open(metrics_file, "rb") as handle:
                    self._answer(200, handle.read())
            else:
                self._answer(404, b"")

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                self._answer(404, b"")
                return
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                completions["n"] += 1
                n = completions["n"]
                if behaviour.get("prefix_cache"):
                    engine = n % engines
                    tokens = request.get("prompt") or []
                    prefix["queries"][engine] += len(tokens)
                    prefix["hits"][engine] += cached_tokens(tokens, prefix["seen"][engine])
            if die_after is not None and n > die_after:
                print(behaviour.get("message", "fake server dying"), file=sys.stderr, flush=True)
                os._exit(1)
            if fail_every and n % fail_every == 0:
                self._answer(500, b'{"error": "fake failure"}')
                return
            if front_s:
                turn = threading.Event()
                front_line.put(turn)
                turn.wait()
                if self._client_gone():
                    return
            self.send_response(200)
            # HTTP/1.0 (http.server's default) without a length: the body ends at close.
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if gate is None:
                self._stream(request)
                return
            with lock:
                gauges["waiting"] += 1
            with gate:
                with lock:
                    gauges["waiting"] -= 1
                    gauges["running"] += 1
                try:
                    self._stream(request)
                except OSError:
                    pass  # the client went away (a ladder step abandoned)
                finally:
                    with lock:
                        gauges["running"] -= 1

        def _stream(self, request: dict) -> None:
            tokens = int(request.get("max_tokens", 1))
            for _ in range(tokens):
                time.sleep(token_delay)
                chunk = {"choices": [{"index": 0, "text": "x"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": 16, "completion_tokens": tokens}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _client_gone(self) -> bool:
            """The request was read whole: a readable socket now means the client closed it."""
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    try:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    except OSError as error:
        # The line uvicorn writes when the port is taken.
        print(
            f"ERROR:    [Errno {error.errno}] error while attempting to bind on address "
            f"('127.0.0.1', {args.port}): {error.strerror.lower()}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    exit_after = behaviour.get("exit_after_s")
    while exit_after is None or time.monotonic() - started < exit_after:
        time.sleep(0.05)
    print(behaviour.get("message", "fake server exiting"), file=sys.stderr, flush=True)
    exit_code = int(behaviour.get("exit_code", 1))
    if exit_code == -signal.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    return exit_code


def cached_tokens(prompt: list, seen: set, block: int = 16) -> int:
    """Tokens of `prompt`'s leading full blocks whose whole prefix is in `seen` (a chain of
    block hashes, as vLLM keys its prefix cache); every block is added to `seen` after."""
    hits, key, matching = 0, None, True
    for start in range(0, len(prompt) - block + 1, block):
        key = hash((key, tuple(prompt[start:start + block])))
        if matching and key in seen:
            hits += block
        else:
            matching = False
        seen.add(key)
    return hits


def slots_at(pairs: list[list[float]], value: float) -> int:
    """The slots of the pair with the highest threshold at or under `value` (1 if none)."""
    return max((slots for low, slots in pairs if low <= value), default=1)


def read_config(path: str) -> dict:
    """A trial's config.yaml as a mapping."""
    import yaml

    with open(path) as handle:
        return yaml.safe_load(handle) or {}


def config_api_processes(path: str) -> int:
    """serving.api_processes of a trial's config.yaml (our section of it)."""
    config = read_config(path)
    serving = ((config.get("additional-config") or {}).get("vllm_autotune") or {}).get("serving") or {}
    return int(serving.get("api_processes", 1))


def config_engine_value(path: str, name: str, default: object) -> object:
    """An engine argument of a trial's config.yaml (either spelling), `default` when unset."""
    config = read_config(path)
    value = config.get(name.replace("_", "-"), config.get(name))
    return default if value is None else value


def config_memory(path: str) -> float:
    """gpu_memory_utilization of a trial's config.yaml (either spelling)."""
    config = read_config(path)
    value = config.get("gpu-memory-utilization", config.get("gpu_memory_utilization"))
    return float(value if value is not None else 0.9)


if __name__ == "__main__":
    sys.exit(main())
