"""The serving engine (serving/engine.py) driven directly, without a server: which requests share a batch,
what each one's client sees (stop strings, budgets, going away), and how a full or dead engine refuses."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import torch

from conftest import random_model
from diffar.decoding.sampling import SamplingConfig
from diffar.generation import ARMethod
from diffar.decoding.result import GenerationResult
from diffar.serving.engine import Busy, Engine, EngineDown, Event, Request

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24], [30]]


@pytest.fixture(scope="module")
def method(tokenizer):
    """The generation method the engine serves: plain AR over a tiny random model."""
    return ARMethod(random_model(0), tokenizer, "continuation")


@pytest.fixture
def batches():
    return []  # the BatchStats of every batch the engine decoded


@pytest.fixture
def engine(method, tokenizer, batches):
    """A running engine with a window long enough that requests submitted together always meet."""
    engine = Engine(method, tokenizer, max_batch_size=8, window_ms=300, on_batch=batches.append)
    engine.start()
    yield engine
    engine.stop()


def alone(method, request: Request) -> list[int]:
    """What the method writes for this request decoded on its own."""
    generator = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
    return method.generate([request.prompt_ids], request.max_tokens, request.sampling, generator=generator).tokens[0]


def serve(engine: Engine, requests: list[Request]) -> list[list[Event]]:
    """Submit the requests together; every event each one's client receives, up to its final one."""
    async def run():
        for r in requests:
            engine.submit(r)
        return [await events(r) for r in requests]

    async def events(r: Request) -> list[Event]:
        received = [await r.events.get()]
        while received[-1].finish_reason is None:
            received.append(await r.events.get())
        return received

    return asyncio.run(run())


def reported(engine: Engine, batches: list) -> list[tuple[int, int]]:
    """(size, rows cancelled) of every batch decoded; the engine is stopped first, as a batch is reported
    after its replies have gone out."""
    engine.stop()
    return [(b.size, b.cancelled) for b in batches]


def shown(events: list[Event]) -> str:
    return "".join(e.text for e in events)


def test_requests_sampling_alike_share_a_batch_each_with_its_own_budget(engine, method, batches):
    requests = [Request(p, max_tokens=n, sampling=GREEDY) for p, n in zip(PROMPTS, (5, 12, 1))]
    replies = serve(engine, requests)
    assert reported(engine, batches) == [(3, 0)] and all(r.passes["batch_size"] == 3 for r in requests)
    for r, events in zip(requests, replies):
        assert r.tokens == alone(method, r) and len(r.tokens) == r.max_tokens  # batched == one at a time
        assert events[-1].finish_reason == "length" and shown(events) == r.text == engine.tokenizer.decode(r.tokens)


def test_each_sampling_gets_its_own_batch(engine, batches):
    requests = [Request(PROMPTS[0], 4, GREEDY), Request(PROMPTS[1], 4, SAMPLED), Request(PROMPTS[2], 4, GREEDY),
                Request(PROMPTS[0], 4, SAMPLED)]
    serve(engine, requests)
    assert reported(engine, batches) == [(2, 0), (2, 0)]
    assert [r.passes["batch_size"] for r in requests] == [2, 2, 2, 2]


def test_a_seeded_sampled_request_is_batched_alone_and_reproducible(engine, method, batches):
    """Its output must not depend on who else was waiting; a seed on a greedy request changes nothing."""
    seeded = [Request(PROMPTS[0], 8, SAMPLED, seed=3), Request(PROMPTS[1], 8, SAMPLED, seed=3),
              Request(PROMPTS[2], 8, SAMPLED)]
    greedy = [Request(PROMPTS[0], 8, GREEDY, seed=3), Request(PROMPTS[1], 8, GREEDY, seed=4)]
    serve(engine, seeded + greedy)
    assert reported(engine, batches) == [(1, 0), (1, 0), (1, 0), (2, 0)]
    assert [r.passes["batch_size"] for r in seeded + greedy] == [1, 1, 1, 2, 2]
    for r in seeded[:2]:
        assert r.tokens == alone(method, r)


def test_a_stop_string_is_held_back_until_known_then_cut(engine, method):
    """The stop string spans two tokens: the first of them must not reach the client before the second shows
    whether it is the stop string, and the text ends just before it."""
    full = Request(PROMPTS[1], 24, GREEDY)
    tokens = alone(method, full)
    decode = engine.tokenizer.decode
    for i in range(1, len(tokens) - 1):
        before, first, stop = decode(tokens[:i]), decode(tokens[i:i + 1]), decode(tokens[i:i + 2])
        clean = all("\ufffd" not in t for t in (before, first, stop)) and decode(tokens[:i + 2]) == before + stop
        if clean and first and len(stop) > len(first) and stop not in before + stop[:-1]:
            break
    else:
        pytest.skip("no two tokens of this output make a clean stop string")
    request = Request(PROMPTS[1], 24, GREEDY, stop=(stop,))
    (events,) = serve(engine, [request])
    assert events[-1].finish_reason == "stop" and request.tokens == tokens[:i + 2]
    assert shown(events) == request.text == before  # nothing of the stop string was ever streamed


def test_a_client_that_goes_away_frees_its_row(engine, method, batches):
    """Its row stops decoding at the next token; the rest of the batch is decoded as if it were not there."""
    @dataclass
    class LeavesAfterThree(Request):
        def push(self, token, origin, tokenizer):
            if len(self.tokens) == 3:
                self.cancelled.set()
            return super().push(token, origin, tokenizer)

    leaving, staying = LeavesAfterThree(PROMPTS[0], 20, GREEDY), Request(PROMPTS[1], 20, GREEDY)
    serve(engine, [leaving, staying])
    assert len(leaving.tokens) == 3 and staying.tokens == alone(method, staying)
    assert reported(engine, batches) == [(2, 1)]


def test_a_request_cancelled_while_waiting_is_never_decoded(engine, batches):
    gone, kept = Request(PROMPTS[0], 4, GREEDY), Request(PROMPTS[1], 4, GREEDY)
    gone.cancelled.set()

    async def run():
        engine.submit(gone)
        engine.submit(kept)
        while (await kept.events.get()).finish_reason is None:
            pass

    asyncio.run(run())
    assert engine.queued() == 0 and reported(engine, batches) == [(1, 0)]
    assert gone.tokens == [] and gone.events.empty()


def test_a_full_queue_refuses_then_serves_what_it_holds(method, tokenizer, batches):
    engine = Engine(method, tokenizer, max_queue=2, window_ms=1000, on_batch=batches.append)
    engine.start()
    try:
        async def run():
            held = [engine.submit(Request(p, 3, GREEDY)) for p in PROMPTS[:2]]  # the window keeps both waiting
            with pytest.raises(Busy) as refused:
                engine.submit(Request(PROMPTS[2], 3, GREEDY))
            assert refused.value.reason == "queue_full" and refused.value.retry_after >= 1
            for r in held:
                while (await r.events.get()).finish_reason is None:
                    pass
            return engine.queued()

        assert asyncio.run(run()) == 0 and reported(engine, batches) == [(2, 0)]
    finally:
        engine.stop()


def test_a_failing_batch_answers_with_an_error_and_the_worker_goes_on(engine):
    too_long = Request([5] * 400, 4, GREEDY)  # past the tiny model's context
    (events,) = serve(engine, [too_long])
    assert events[-1].finish_reason == "error" and "context" in events[-1].error
    (events,) = serve(engine, [Request(PROMPTS[0], 2, GREEDY)])
    assert events[-1].finish_reason == "length" and engine.alive


def test_an_engine_whose_worker_is_down_refuses(method, tokenizer):
    engine = Engine(method, tokenizer)

    async def submit():
        engine.submit(Request(PROMPTS[0], 2, GREEDY))

    with pytest.raises(EngineDown):  # never started
        asyncio.run(submit())
    engine.start()
    engine.stop()
    with pytest.raises(EngineDown):  # stopped
        asyncio.run(submit())


@dataclass
class Clockwork:
    """A generation method whose batches take STEP seconds per token of their longest row (timed by sleeping),
    so the engine's estimate of a step is known. Writes token 1."""

    STEP = 0.01
    tokenizer: object
    name = "clockwork"

    def settings(self, options):
        return GREEDY

    def prompt(self, text):
        return [1]

    def room(self, ids, settings):
        return 1000

    def fits(self, longest, budget):
        return True

    def generate(self, prompts, budgets, settings, *, on_token=None, **_):
        budgets = budgets if isinstance(budgets, list) else [budgets] * len(prompts)
        time.sleep(self.STEP * max(budgets))
        for row, n in enumerate(budgets):
            for _ in range(n):
                if on_token and on_token(row, 1, "ar") is False:
                    break
        return GenerationResult(tokens=[[1] * n for n in budgets], ended=[False] * len(prompts), passes={},
                                seconds=0.0)


def test_admission_refuses_what_it_could_not_answer_in_time(tokenizer):
    """Estimated wait = tokens asked for by the waiting requests / batch size x measured step cost: with 0.01 s a
    step, 4 rows a batch and 20 tokens a request, each waiting request adds ~0.05 s, so a bound of 0.5 s admits
    about eleven of a burst (plus the first batch, taken while the burst arrives) and refuses the rest."""
    engine = Engine(Clockwork(tokenizer), tokenizer, max_batch_size=4, window_ms=10, max_wait_s=0.5)
    engine.start()
    try:
        assert engine.step_seconds == pytest.approx(Clockwork.STEP, rel=0.5)

        async def burst():
            admitted, refused = [], []
            for _ in range(40):
                try:
                    admitted.append(engine.submit(Request([1], 20, GREEDY)))
                except Busy as e:
                    refused.append(e)
            for r in admitted:
                while (await r.events.get()).finish_reason is None:
                    pass
            return admitted, refused

        admitted, refused = asyncio.run(burst())
        assert 8 <= len(admitted) <= 16, len(admitted)
        assert all(len(r.tokens) == 20 for r in admitted)  # everything admitted is answered in full
        assert all(e.reason == "overloaded" and e.retry_after == 1 for e in refused)  # ~0.55 s to drain
        assert engine.queued() == 0 and engine._pending_tokens == 0
    finally:
        engine.stop()


def test_a_compiled_method_is_warmed_at_every_batch_size_it_pads_to(tokenizer):
    """A compiled method makes a graph per batch size and pads batches to powers of two: the warm-up runs
    each of them below the full batch (which the step measure runs), so that no request waits for a compile."""

    class Compiled(Clockwork):
        compiled = True
        sizes: list[int] = []

        def generate(self, prompts, budgets, settings, **kwargs):
            self.sizes.append(len(prompts))
            return super().generate(prompts, budgets, settings, **kwargs)

    method = Compiled(tokenizer)
    engine = Engine(method, tokenizer, max_batch_size=6)
    engine.start()
    engine.stop()
    assert method.sizes == [1, 2, 4, 6, 6]
