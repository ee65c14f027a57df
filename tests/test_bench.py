"""The bench's measuring loop: methods interleaved batch by batch, warmed up before they are timed."""

from diffar.decoding.result import GenerationResult
from diffar.evaluation.bench import _interleaved


def test_methods_take_turns_and_warm_up_first():
    calls = []

    def runner(name):
        def run(rows):
            calls.append((name, rows.start))
            return GenerationResult([[rows.start]], 0.0, {"target": 1}, [False])
        return run
    batches = [range(i, i + 1) for i in range(3)]
    runs = _interleaved({"a": runner("a"), "b": runner("b"), "c": runner("c")}, batches, warm_every={"c"})
    # each batch's first method rotates; every method runs batch 0 twice (a warm-up), "c" (compiled) every batch
    assert calls == [("a", 0), ("a", 0), ("b", 0), ("b", 0), ("c", 0), ("c", 0),
                     ("b", 1), ("c", 1), ("c", 1), ("a", 1),
                     ("c", 2), ("c", 2), ("a", 2), ("b", 2)]
    assert {name: [r.tokens[0][0] for r in results] for name, results in runs.items()} == \
        {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, 2]}
