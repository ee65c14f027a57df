"""DD2 served over HTTP (`diffar serve`): seeded requests match the library, streams, clear 400s."""

from __future__ import annotations

import json

import httpx
import torch

from conftest import assert_clean_error, run_cli, serving
from diffar.checkpoint import load_checkpoint
from diffar.decoding.dd2 import DD2Sampling, best_of_generate, dd2_generate


def test_serve_dd2(tiny_dd2, tiny_vqvae, tiny_run):
    """A DD2 checkpoint is served as method dd2: a seeded request gives exactly what dd2_generate gives for
    that seed, a stream carries the same text, and what DD2 cannot do is a 400."""
    model, tokenizer, _ = load_checkpoint(tiny_dd2 / "x0")
    prompt = "In the beginning God created the heaven and the earth."
    with serving(tiny_dd2 / "x0") as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["methods"] == ["dd2"]
        body = {"prompt": prompt, "max_tokens": 12, "seed": 5}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, eos_id=tokenizer.eos_id,
                                generator=torch.Generator().manual_seed(5))
        assert out["diffar"]["method"] == "dd2" and out["diffar"]["token_ids"] == expected.tokens[0]
        assert out["choices"][0]["text"] == tokenizer.decode(expected.tokens[0])
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
        guided = httpx.post(url + "/v1/completions", json={**body, "steps": 3, "guidance_scale": 2}, timeout=60)
        assert guided.status_code == 200 and guided.json()["diffar"]["method"] == "dd2"
        assert guided.json()["diffar"]["passes"] == {"steps": 3, "denoiser": 3, "decoder": 1, "batch_size": 1}
        # a multi-step stream shows the whole text after each step (empty deltas), then the final text
        quality = {**body, "preset": "quality", "steps": 4}
        final = httpx.post(url + "/v1/completions", json=quality, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", url + "/v1/completions", json={**quality, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        snapshots = [c["diffar"]["snapshot"] for c in chunks if "snapshot" in c.get("diffar", {})]
        assert [s["step"] for s in snapshots] == [1, 2, 3, 4] and snapshots[-1]["text"] == final
        assert all(c["choices"][0]["text"] == "" for c in chunks if "snapshot" in c.get("diffar", {}))
        assert "".join(c["choices"][0]["text"] for c in chunks) == final
        pinned = httpx.post(url + "/v1/completions", json={**body, "fixed_tokens": {"1": 5, "3": 6}}, timeout=60)
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, eos_id=tokenizer.eos_id,
                                generator=torch.Generator().manual_seed(5), fixed=[{1: 5, 3: 6}])
        assert pinned.json()["diffar"]["token_ids"] == expected.tokens[0]
        assert expected.tokens[0][1] == 5 and expected.tokens[0][3] == 6
        picked = httpx.post(url + "/v1/completions", json={**body, "best_of": 3}, timeout=60).json()
        expected = best_of_generate(model, None, [tokenizer.encode(prompt)], None, 12, sampling=DD2Sampling(best_of=3),
                                    eos_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(5))
        assert picked["diffar"]["token_ids"] == expected.tokens[0]  # no judge: the decoder's own pick
        assert picked["diffar"]["passes"]["denoiser"] == 1 and "judge" not in picked["diffar"]["passes"]
        sampled = httpx.post(url + "/v1/completions", json={**body, "tau_min": 1.5}, timeout=60).json()
        expected = dd2_generate(model, [tokenizer.encode(prompt)], 12, sampling=DD2Sampling(tau_min=1.5),
                                eos_id=tokenizer.eos_id, generator=torch.Generator().manual_seed(5))
        assert sampled["diffar"]["token_ids"] == expected.tokens[0] != out["diffar"]["token_ids"]
        for bad, param in [({"method": "ar"}, "method"), ({"prompt": "word " * 200}, "prompt"),
                           ({"max_tokens": 500}, "max_tokens"), ({"best_of": 2, "stream": True}, "best_of"),
                           ({"tau": 0.5}, "tau")]:
            r = httpx.post(url + "/v1/completions", json={**body, **bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_vqvae), "does not generate text")
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_run, "--method", "dd2"),
                       "cannot decode")


def test_serve_dd2_best_of(tiny_dd2, tiny_run):
    """With --judge, a request's best_of samples are drawn and the judge keeps one: a seeded request gives
    exactly what best_of_generate gives for that seed; best_of cannot be streamed."""
    model, tokenizer, _ = load_checkpoint(tiny_dd2 / "x0")
    judge, _, _ = load_checkpoint(tiny_run)
    prompt = "In the beginning God created the heaven and the earth."
    with serving(tiny_dd2 / "x0", "--judge", tiny_run) as url:
        body = {"prompt": prompt, "max_tokens": 12, "seed": 5, "best_of": 3}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        source = tokenizer.encode(prompt)
        expected = best_of_generate(model, judge, [source], [source + [tokenizer.sep_id]], 12,
                                    sampling=DD2Sampling(best_of=3), eos_id=tokenizer.eos_id,
                                    generator=torch.Generator().manual_seed(5))
        assert out["diffar"]["token_ids"] == expected.tokens[0]
        assert out["diffar"]["passes"] == {"steps": 1, "denoiser": 1, "decoder": 1, "judge": 1, "batch_size": 1}
        r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert_clean_error(run_cli("serve", "--checkpoint", tiny_run, "--judge", tiny_run), "judge applies to method dd2 only, not to ar")
