"""`diffar loadtest`: many concurrent clients against a diffar server on this machine, bounded in request
count and time. Reports latency percentiles, throughput, errors and lost requests.

Without --url it starts the server itself on a free 127.0.0.1 port — once with dynamic batching and, with
--compare-unbatched, once serving one request at a time — so the two are measured side by side.
"""

from __future__ import annotations

import asyncio
import math
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import httpx

from diffar.errors import DiffarError
from diffar.evaluation.hardware import cpu_name

POOL = 50  # client connections per httpx pool


@dataclass
class LoadResult:
    label: str
    max_batch_size: int | None
    concurrency: int
    requests: int  # sent
    completed: int  # answered 200
    errors: int  # answered otherwise (429s included), or failed in transport
    lost: int  # sent but never answered before the time limit
    shed: int  # answered 429 (busy: retry later) after the client's last retry
    retries: int  # requests sent again after a 429
    gave_up: int  # clients that stopped waiting after --client-timeout (answered neither way in time)
    error_kinds: dict  # HTTP status or exception name -> count
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_tokens: int
    client_timeout: float | None = None
    device: str = ""


def _percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    if not sorted_values:
        return float("nan")
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


async def _drive(url: str, prompts: list[str], concurrency: int, total: int, max_tokens: int, time_limit: float,
                 client_timeout: float | None, max_retries: int
                 ) -> tuple[list[float], int, int, Counter, int, float, int]:
    """(latencies of successes, sent, completed, errors by kind, completion tokens, seconds, retries). A client
    that waits `client_timeout` for an answer gives up (errors["gave up"]) and sends its next request; a 429 is
    retried after its Retry-After up to `max_retries` times."""
    latencies: list[float] = []
    sent = completed = tokens = retries = 0
    errors: Counter = Counter()
    deadline = time.perf_counter() + time_limit

    # Clients share connection pools of POOL connections each: one pool of a thousand costs the client more
    # CPU than the server spends answering (httpcore scans its pool per request), a pool per client
    # costs a TLS context each.
    pools = [httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(time_limit),
                               limits=httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL))
             for _ in range(math.ceil(concurrency / POOL))]

    async def post(client: httpx.AsyncClient, body: dict, t0: float) -> httpx.Response:
        """The request, sent again after a 429's Retry-After while retries and the client's patience last (as
        OpenAI's client does). Raises TimeoutException when the patience or the run's time runs out."""
        nonlocal retries
        end = min(deadline, t0 + client_timeout) if client_timeout else deadline
        attempt = 0
        while True:
            left = max(0.1, end - time.perf_counter())  # the whole wait (pool, send, answer), not each phase's
            try:
                r = await asyncio.wait_for(client.post("/v1/completions", json=body, timeout=left), left)
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout("out of patience") from None
            wait = float(r.headers.get("retry-after", 1)) if r.status_code == 429 else 0.0
            if not wait or attempt == max_retries or time.perf_counter() + wait >= end:
                return r
            attempt, retries = attempt + 1, retries + 1
            await asyncio.sleep(wait)

    async def client_loop(client: httpx.AsyncClient):
        """One client: one request at a time until the run's budget of requests or time is spent."""
        nonlocal sent, completed, tokens
        while sent < total and time.perf_counter() < deadline:
            body = {"prompt": prompts[sent % len(prompts)], "max_tokens": max_tokens, "temperature": 0}
            sent += 1
            t0 = time.perf_counter()
            try:
                r = await post(client, body, t0)
                n = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
            except httpx.TimeoutException:
                if time.perf_counter() < deadline:  # this client's patience ran out, not the run's time
                    errors["gave up"] += 1
                    continue
                return  # sent, never answered in time: counted as lost
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                errors[type(e).__name__] += 1  # refused, broken, or a 200 that is not a completion
                continue
            if n is None:
                errors[f"HTTP {r.status_code}"] += 1
                continue
            completed += 1
            tokens += n
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(pools[i % len(pools)]) for i in range(concurrency)))
    seconds = time.perf_counter() - t0
    for pool in pools:
        await pool.aclose()
    return sorted(latencies), sent, completed, errors, tokens, seconds, retries


def run_load(url: str, prompts: list[str], *, concurrency: int, requests: int, max_tokens: int, time_limit: float,
             label: str, max_batch_size: int | None, client_timeout: float | None = None,
             max_retries: int = 2) -> LoadResult:
    latencies, sent, completed, errors, tokens, seconds, retries = asyncio.run(
        _drive(url, prompts, concurrency, requests, max_tokens, time_limit, client_timeout, max_retries))
    n_errors = sum(errors.values())
    return LoadResult(
        label=label, max_batch_size=max_batch_size, concurrency=concurrency, requests=sent, completed=completed,
        errors=n_errors, lost=sent - completed - n_errors, shed=errors["HTTP 429"], gave_up=errors["gave up"],
        retries=retries,
        error_kinds=dict(errors), seconds=round(seconds, 2),
        requests_per_s=round(completed / seconds, 2), tokens_per_s=round(tokens / seconds, 1),
        p50_ms=round(1000 * _percentile(latencies, 0.50), 1), p95_ms=round(1000 * _percentile(latencies, 0.95), 1),
        p99_ms=round(1000 * _percentile(latencies, 0.99), 1), max_tokens=max_tokens, client_timeout=client_timeout,
        device=cpu_name())


def raise_fd_limit() -> None:
    """A thousand open sockets need more than the common default of 1024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextmanager
def local_server(checkpoint: str, max_batch_size: int, max_queue: int, max_wait_s: float = 3.0):
    """`diffar serve` in a child process on a free loopback port; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would block the server once full
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffar.cli", "serve", "--checkpoint", checkpoint, "--port", str(port),
         "--max-batch-size", str(max_batch_size), "--max-queue", str(max_queue), "--max-wait-s", str(max_wait_s)],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise DiffarError(f"the server did not start: {log.read().strip().splitlines()[-1:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise DiffarError("the server did not answer /health within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def print_results(results: list[LoadResult]) -> None:
    print(f"{'server':<22}{'conc':>6}{'sent':>7}{'ok':>7}{'429':>6}{'err':>5}{'lost':>5}{'req/s':>8}{'tok/s':>9}"
          f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}")
    for r in results:
        print(f"{r.label:<22}{r.concurrency:>6}{r.requests:>7}{r.completed:>7}{r.shed:>6}{r.errors - r.shed:>5}"
              f"{r.lost:>5}{r.requests_per_s:>8.2f}{r.tokens_per_s:>9.1f}{r.p50_ms:>9.0f}{r.p95_ms:>9.0f}"
              f"{r.p99_ms:>9.0f}")
    for r in results:
        if r.error_kinds:
            print(f"{r.label} errors: {r.error_kinds}")
    if len(results) == 2 and results[1].tokens_per_s > 0:
        print(f"dynamic batching throughput: {results[0].tokens_per_s / results[1].tokens_per_s:.2f}x "
              f"one-request-at-a-time")
    print(f"device: {results[0].device}; clients and server share this machine")


def results_json(results: list[LoadResult]) -> list[dict]:
    return [asdict(r) for r in results]
