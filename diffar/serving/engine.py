"""Dynamic batching: requests that arrive within a short window are decoded together.

A single worker thread owns the model and its generation method (diffar/generation). It takes the oldest
waiting request, waits up to `window_ms` for more with the same sampling settings (up to `max_batch_size`),
and decodes them as one batch; each row stops on its own (eos, its token budget, a stop string, or its
client going away). Tokens are handed to the asyncio side as they are produced, so streaming clients see
them live. The waiting line is bounded twice: by length (`max_queue`), and by the time a new request would
wait before its batch starts — admission control estimates it from the tokens already asked for and the
measured cost of a decoding step (first measured by a warm-up batch at start), and refuses a request that would
wait longer than `max_wait_s` rather than queueing work its client will have given up on.
A seeded sampled request (and a seeded DD2 request: DD2 always draws its starting noise) runs in a batch of
its own, so its output is reproducible under any load.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from diffar.decoding.dd2 import DD2Sampling
from diffar.decoding.result import DIFFUSION, PINNED, GenerationResult
from diffar.decoding.sampling import SamplingConfig
from diffar.generation.method import Options
from diffar.tokenizer import Tokenizer

WARMUP_TOKENS = 8  # per row of the warm-up batch
STEP_SMOOTHING = 0.3  # weight of the newest batch in the running estimate of a decoding step's cost


class Busy(Exception):
    """The engine cannot take the request now (HTTP 429): its line is full (`reason` "queue_full") or the
    estimated wait exceeds the bound ("overloaded"). `retry_after`: seconds until the waiting line has drained
    (not merely fallen under the bound: clients told to come back together would mostly be refused again)."""

    def __init__(self, reason: str, message: str, retry_after: int):
        super().__init__(message)
        self.reason, self.retry_after = reason, retry_after


class EngineDown(Exception):
    """The worker thread is not running; nothing submitted would ever be answered (HTTP 503)."""


@dataclass
class Event:
    """What a request's consumer receives: text deltas, then one final event."""

    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None while running
    error: str | None = None
    snapshot: dict | None = None  # a multi-step DD2 sample's whole canvas after one denoising step
    origins: list[str] = field(default_factory=list)  # who wrote the tokens since the last text delta


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig | DD2Sampling
    stop: tuple[str, ...] = ()
    seed: int | None = None
    fixed: dict[int, int] = field(default_factory=dict)  # output position -> pinned token
    stream: bool = True  # False: the consumer wants only the final event (no per-token wake-ups)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # filled in by the worker
    tokens: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # who wrote each token (decoding/result.py)
    streamed: int = 0  # the origins already sent with a text delta
    text: str = ""
    stop_hit: bool = False
    passes: dict = field(default_factory=dict)  # the forward passes of the batch that decoded it, by kind

    def batch_key(self) -> tuple:
        """Requests batch together only when one sampling procedure serves them all. A seeded sampled
        request runs alone, so its output depends on its seed and not on who else was waiting."""
        if isinstance(self.sampling, SamplingConfig) and self.sampling.greedy:
            return (self.sampling,)
        return (self.sampling, id(self)) if self.seed is not None else (self.sampling,)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's event loop (which may be gone if the server is stopping)."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # closed between the check and the call
            pass

    def push(self, token: int, origin: str, tokenizer: Tokenizer) -> bool:
        """Take one generated token and who wrote it, stream what is safe to show; False once the request is
        finished.

        Text that could be the start of a stop string is held back until it is known not to be one.
        """
        if self.cancelled.is_set():
            return False
        self.tokens.append(token)
        self.origins.append(origin)
        text = tokenizer.decode_complete(self.tokens)
        if text is None:  # half of a multi-byte character: wait for the rest
            return len(self.tokens) < self.max_tokens
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stop_hit = True
            self._show(text[:cut])
            return False
        self._show(text[: len(text) - _stop_prefix_len(text, self.stop)])
        return len(self.tokens) < self.max_tokens

    def snapshot(self, step: int, tokens: list[int], tokenizer: Tokenizer) -> None:
        """Stream the whole canvas as it stands after denoising step `step` (1-based), token by token (a page
        pins from any step); it may still change. Only DD2 forms its text in steps: its decoder wrote it all
        but the pins."""
        if self.stream and not self.cancelled.is_set():
            ids = tokens[:self.max_tokens]
            self.emit(Event(snapshot={"step": step, "text": tokenizer.decode(ids), "token_ids": ids,
                                      "tokens": pieces(ids, tokenizer),
                                      "origins": [PINNED if i in self.fixed else DIFFUSION for i in range(len(ids))]}))

    def finish(self, tokenizer: Tokenizer) -> None:
        if not self.stop_hit:
            self._show(tokenizer.decode(self.tokens))
        stopped = self.stop_hit or len(self.tokens) < self.max_tokens
        self.emit(Event(finish_reason="stop" if stopped else "length"))

    def _show(self, text: str) -> None:
        if len(text) > len(self.text):
            if self.stream:
                self.emit(Event(text=text[len(self.text):], origins=self.origins[self.streamed:]))
                self.streamed = len(self.origins)
            self.text = text


def pieces(ids: list[int], tokenizer: Tokenizer) -> list[str]:
    """Each token's own text, for a page that shows (and pins) them one by one."""
    return [tokenizer.decode([t]) for t in ids]


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)


@dataclass
class BatchStats:
    size: int
    new_tokens: int
    seconds: float
    cancelled: int = 0  # rows whose client went away mid-generation


class Engine:
    """Owns one model's generation method (diffar/generation) and the worker thread that runs it."""

    def __init__(self, method, tokenizer: Tokenizer, *, max_batch_size: int = 16, window_ms: float = 10.0,
                 max_queue: int = 4096, max_wait_s: float | None = None, on_batch=None):
        self.method, self.tokenizer = method, tokenizer
        self.max_batch_size, self.window, self.max_queue = max_batch_size, window_ms / 1000, max_queue
        self.max_wait_s = max_wait_s  # None: no bound on the estimated wait (the line's length still is)
        self.on_batch = on_batch  # called with BatchStats after every batch (metrics)
        self.incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._held: deque[Request] = deque()  # taken from `incoming`, passed over by the last batch
        self._waiting = 0  # submitted, not yet in a batch: bounded by max_queue
        self._pending_tokens = 0  # the token budgets of those waiting requests
        self.step_seconds: float | None = None  # a decoding step's running cost (None: not measured yet)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()  # the warm-up is over
        self._thread = threading.Thread(target=self._run, name="diffar-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the worker; returns once its warm-up batch is done (nobody else may use the method meanwhile)."""
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def submit(self, request: Request) -> Request:
        if not self.alive:
            raise EngineDown
        request.loop = request.loop or asyncio.get_running_loop()
        with self._lock:
            self.admit()
            self._waiting += 1
            self._pending_tokens += request.max_tokens
        self.incoming.put(request)
        return request

    def admit(self) -> None:
        """Raise Busy if a new request should be refused now. It does not depend on the request (its own
        generation is not part of its wait), so a server may ask before reading a body."""
        wait = self.estimated_wait()
        if self._waiting >= self.max_queue:
            raise Busy("queue_full", f"server busy: {self._waiting} requests are waiting, the most it holds",
                       max(1, math.ceil(wait or 1)))
        if wait is not None and self.max_wait_s is not None and wait > self.max_wait_s:
            raise Busy("overloaded", f"server busy: a new request would wait ~{wait:.1f} s, over its bound of "
                                     f"{self.max_wait_s:g} s", math.ceil(wait))  # when the line will have drained

    def queued(self) -> int:
        return self._waiting

    def estimated_wait(self) -> float | None:
        """Seconds a new request would wait before its batch starts, if every waiting request used its whole
        budget in full batches at the measured step cost (an upper bound when rows end early); None before
        the first measure. Its own generation is not counted: an idle server admits any request."""
        if self.step_seconds is None:
            return None
        return self._pending_tokens / self.max_batch_size * self.step_seconds

    def _observe_step(self, seconds: float, rows: list[list[int]]) -> None:
        steps = max((len(r) for r in rows), default=0)
        if steps:
            cost = seconds / steps
            old = self.step_seconds
            self.step_seconds = cost if old is None else (1 - STEP_SMOOTHING) * old + STEP_SMOOTHING * cost

    # ---- worker -----------------------------------------------------------------------------------
    def _next(self, timeout: float) -> Request | None:
        if self._held:
            return self._held.popleft()
        try:
            return self.incoming.get(timeout=timeout)
        except queue.Empty:
            return None

    def _collect(self) -> list[Request]:
        """The oldest waiting request plus those that can share its batch, arriving within the window.

        A request joins if it samples the same way and the batch still fits the context; others keep
        their place in line. At most `max_batch_size` are passed over per batch, so the scan is bounded.
        """
        first = self._next(timeout=0.1)
        if first is None:
            return []
        batch, passed = [first], []
        key, deadline = first.batch_key(), time.perf_counter() + self.window
        longest, budget = len(first.prompt_ids), first.max_tokens
        while len(batch) < self.max_batch_size and len(passed) < self.max_batch_size:
            nxt = self._next(timeout=max(0.0, deadline - time.perf_counter()))
            if nxt is None:
                break
            fits = self.method.fits(max(longest, len(nxt.prompt_ids)), max(budget, nxt.max_tokens))
            if nxt.batch_key() == key and fits:
                batch.append(nxt)
                longest, budget = max(longest, len(nxt.prompt_ids)), max(budget, nxt.max_tokens)
            else:
                passed.append(nxt)
        self._held.extendleft(reversed(passed))  # keep arrival order for the next batch
        with self._lock:
            self._waiting -= len(batch)
            self._pending_tokens -= sum(r.max_tokens for r in batch)
        return [r for r in batch if not r.cancelled.is_set()]

    def _warm_up(self) -> None:
        """A full batch of a few tokens before the first request: the method's buffers made, and a first
        measure of a decoding step at full batch for admission control; a compiled method's graphs made for
        every batch size it pads to (powers of two), so that no request waits for a compile. A failure only
        skips the measure."""
        try:
            settings = self.method.settings(Options())
            ids = self.method.prompt("Hello")
            budget = min(WARMUP_TOKENS, self.method.room(ids, settings))
            size = 1
            while getattr(self.method, "compiled", False) and size < self.max_batch_size and budget > 1:
                self.method.generate([ids] * size, 2, settings)  # the second token is the first compiled step
                size *= 2
            for _ in range(2 if budget > 0 else 0):  # the first call pays one-time costs: measure the second
                t0 = time.perf_counter()
                result = self.method.generate([ids] * self.max_batch_size, budget, settings)
            if budget > 0:
                self._observe_step(time.perf_counter() - t0, result.tokens)
        except Exception:  # noqa: BLE001 - the server still serves; its waits are measured on real batches
            pass

    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self._warm_up()
            finally:
                self._ready.set()
            while not self._stop.is_set():
                batch = []
                try:
                    batch = self._collect()
                    if batch:
                        self._decode(batch)
                except Exception as e:  # never let one bad batch kill the worker
                    for r in batch:
                        r.emit(Event(finish_reason="error", error=f"{type(e).__name__}: {e}"))

    def _decode(self, batch: list[Request]) -> None:
        generator = torch.Generator().manual_seed(batch[0].seed) if batch[0].seed is not None else None
        tok = self.tokenizer

        def on_step(i: int, rows: list[list[int]]) -> None:
            for request, tokens in zip(batch, rows):
                request.snapshot(i + 1, tokens, tok)

        streaming = any(r.stream for r in batch)  # a DD2 snapshot costs a decoder pass per step
        t0 = time.perf_counter()
        result = self.method.generate([r.prompt_ids for r in batch], [r.max_tokens for r in batch], batch[0].sampling,
                                      on_token=lambda row, token, origin: batch[row].push(token, origin, tok),
                                      on_step=on_step if streaming else None, generator=generator,
                                      fixed=[r.fixed for r in batch])
        seconds = time.perf_counter() - t0
        self._observe_step(seconds, result.tokens)
        passes = batch_passes(result, len(batch))
        cancelled = sum(r.cancelled.is_set() for r in batch)  # before finish(): consumers then mark theirs done
        for r in batch:
            r.passes = passes
            r.finish(tok)
        if self.on_batch:
            self.on_batch(BatchStats(len(batch), sum(len(r.tokens) for r in batch), seconds, cancelled))


def batch_passes(result: GenerationResult, batch_size: int) -> dict:
    """What a response says of the batch that decoded it: its forward passes by kind, the batch size, and
    DD2's denoising steps or the share of drafts the AR model accepted."""
    report = {**result.passes, "batch_size": batch_size}
    if "steps" in result.extra:
        report["steps"] = result.extra["steps"]
    if result.extra.get("drafted"):
        report["drafts_accepted"] = round(result.extra["accepted"] / result.extra["drafted"], 3)
    return report
