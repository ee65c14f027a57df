"""Every registered generation method answers the one protocol, and gives the same text for the same seed
whether it is called as a library, through `diffar generate`, through the server or through a benchmark."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import assert_clean_error, run_cli
from diffar.decoding.refusion import DraftSchedule
from diffar.evaluation.bench import _interleaved, _runner
from diffar.generation import METHODS, GenerationMethod, OptionError, Options, load_method
from diffar.serving.app import create_app

PROMPT = "And God said, Let there be light: and there was light."
# method, the flags that choose it, its options, the request fields that ask for the same
CASES = [
    ("ar", (), Options(), {"temperature": 0}),
    ("ar", ("--temperature", "0.9", "--top-p", "0.9"), Options(temperature=0.9, top_p=0.9),
     {"temperature": 0.9, "top_p": 0.9}),
    ("refusion", (), Options(), {"temperature": 0}),
    ("dd2", ("--steps", "2"), Options(steps=2), {"steps": 2}),
]


@pytest.fixture(scope="module")
def checkpoints(tiny_run, tiny_refusion, tiny_dd2):
    return {"ar": tiny_run, "refusion": tiny_refusion, "dd2": tiny_dd2 / "x0"}


def test_every_method_answers_the_protocol(checkpoints):
    known = {f.name for f in dataclasses.fields(Options)}
    for name, cls in METHODS.items():
        method = load_method(str(checkpoints[name]), name)
        assert isinstance(method, GenerationMethod) and isinstance(method, cls) and method.name == name
        assert method.options <= known
        ids = method.prompt(PROMPT)
        settings = method.settings(Options())
        assert ids and method.room(ids, settings) > 0 and method.fits(len(ids), 4)
        budgets = [3, 5]
        streamed = [[], []]  # who wrote each token, as the callback hears it
        out = method.generate([ids, ids], budgets, settings, generator=torch.Generator().manual_seed(0),
                              fixed=[{1: ids[0]}, {}], on_token=lambda row, token, origin: streamed[row].append(origin))
        assert all(len(t) <= b for t, b in zip(out.tokens, budgets)) and out.seconds > 0 and out.forward_passes > 0
        assert out.origins == streamed and list(map(len, out.origins)) == list(map(len, out.tokens))
        assert out.origins[0][1] == "pinned" and "pinned" not in out.origins[0][:1] + out.origins[1]
        assert len(out.ended) == 2 and all(isinstance(v, int) for v in out.passes.values())


@pytest.mark.parametrize("name,flags,options,fields", CASES)
def test_same_text_through_library_cli_server_and_bench(checkpoints, name, flags, options, fields):
    checkpoint = str(checkpoints[name])
    method = load_method(checkpoint, name)
    settings = method.settings(options)
    ids = method.prompt(PROMPT)
    library = method.generate([ids], 12, settings, generator=torch.Generator().manual_seed(7)).tokens[0]
    text = method.tokenizer.decode(library)

    cli = run_cli("generate", "--checkpoint", checkpoint, "--method", name, "--prompt", PROMPT,
                  "--max-new-tokens", "12", "--seed", "7", *flags)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == text + "\n"

    with TestClient(create_app(method, "tiny")) as client:
        served = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": 7, **fields})
    assert served.status_code == 200, served.text
    assert served.json()["diffar"]["token_ids"] == library

    runner = _runner(method, settings, [ids], lambda rows: 12, generator=torch.Generator().manual_seed(7))
    benched = _interleaved({name: runner}, [range(1)])[name]
    if name != "dd2" and settings.greedy:  # else the bench's warm-up run draws from the generator first
        assert benched[0].tokens[0] == library


def test_options_a_method_cannot_honour(checkpoints):
    dd2 = load_method(str(checkpoints["dd2"]))
    with pytest.raises(OptionError) as e:
        dd2.settings(Options(tau=0.5))  # one step reads out at tau_min
    assert e.value.option == "tau"
    with pytest.raises(OptionError, match="judge applies to method dd2 only, not to ar"):
        load_method(str(checkpoints["ar"]), judge=str(checkpoints["ar"]))
    with pytest.raises(OptionError, match="cannot decode"):
        load_method(str(checkpoints["ar"]), "dd2")
    refusion = load_method(str(checkpoints["refusion"]), schedule=DraftSchedule(dynamic=True))
    assert refusion.label == "refusion-dynamic"
    assert_clean_error(run_cli("generate", "--checkpoint", checkpoints["ar"], "--prompt", "x", "--steps", "2"),
                       "--steps: not read by --method ar")
