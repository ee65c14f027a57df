"""The domain adapter (models/domain_adapter.py), the corpus mixtures it trains on, and choosing a domain when
decoding: a mixture's records keep their labels through batching, the gate starts nearly closed, and a
domain-adapted ReFusion model decodes losslessly for the domain it is told, refusing to guess one."""

import httpx
import pytest
import torch

from diffar.checkpoint import read_meta
from diffar.data.batching import build_dataset
from diffar.data.corpora import Corpus, Pair, load_corpus
from diffar.errors import DiffarError
from diffar.models.domain_adapter import DomainAdapter
from diffar.models.refusion import RefusionConfig, RefusionModel

from conftest import TINY_TRAIN, assert_clean_error, run_cli, serving


def test_a_mixture_labels_each_record_with_its_corpus():
    shakespeare, rv1909 = load_corpus("shakespeare", "valid"), load_corpus("rv1909", "valid")
    mix = load_corpus("shakespeare,rv1909", "valid")
    assert mix.task == "continuation"
    assert mix.documents == shakespeare.documents + rv1909.documents
    assert mix.domains == ["shakespeare"] * len(shakespeare.documents) + ["rv1909"] * len(rv1909.documents)


@pytest.mark.parametrize("name, message", [
    ("kjv2web,shakespeare", "must be of one task"),
    ("kjv2web,kjv2web", "each corpus once"),
    ("kjv2web,", "each corpus once"),
])
def test_bad_mixtures_are_refused(name, message):
    with pytest.raises(DiffarError, match=message):
        load_corpus(name, "valid")


def test_window_batches_say_each_window_s_domain(tokenizer):
    corpus = Corpus("a,b", "continuation", documents=["alpha beta gamma " * 40, "delta epsilon " * 40],
                    domains=["a", "b"])
    data = build_dataset(corpus, tokenizer, 16, domains=("b", "a"))
    first_len = len(tokenizer.encode(corpus.documents[0])) + 1  # its eos
    batch = data.batch([0, first_len - 1, first_len, len(data) - 1])
    assert batch["domain"].tolist() == [1, 1, 0, 0]  # indices into the model's domains, not the mixture's order
    assert "domain" not in build_dataset(corpus, tokenizer, 16).batch([0])  # a model without an adapter


def test_pair_batches_keep_labels_past_dropped_pairs(tokenizer):
    pairs = [Pair("short one", "brief"), Pair("long " * 200, "too long"), Pair("short two", "small")]
    corpus = Corpus("x,y", "seq2seq", pairs=pairs, domains=["x", "x", "y"])
    data = build_dataset(corpus, tokenizer, 32, domains=("x", "y"))
    assert data.dropped == 1
    assert data.batch([0, 1])["domain"].tolist() == [0, 1]


def test_data_of_a_domain_the_model_lacks_is_refused(tokenizer):
    corpus = Corpus("a,b", "continuation", documents=["one two " * 30, "three four " * 30], domains=["a", "b"])
    with pytest.raises(DiffarError, match="also of b"):
        build_dataset(corpus, tokenizer, 16, domains=("a",))


def test_evaluation_windows_span_the_whole_mixture(tokenizer):
    corpus = Corpus("a,b", "continuation", documents=["one two " * 200, "three four " * 200], domains=["a", "b"])
    data = build_dataset(corpus, tokenizer, 16, domains=("a", "b"))
    picked = data.eval_indices(4)
    assert len(picked) == 4 and picked == sorted(set(picked))
    domains = data.batch(picked)["domain"].tolist()
    assert domains[0] == 0 and domains[-1] == 1  # not only the first document's windows


def test_the_gate_starts_nearly_closed_and_mixes_per_row():
    torch.manual_seed(0)
    adapter = DomainAdapter(3, 32)
    h = torch.randn(2, 5, 32)
    domain = torch.tensor([0, 2])
    assert (adapter(h, domain) - h).norm() < 0.05 * h.norm()  # a new adapter barely changes the stream
    with torch.no_grad():
        adapter.embedding.weight.copy_(torch.arange(3.0).view(3, 1).expand(3, 32))
        adapter.gate.bias.fill_(50.0)  # open: h' is the row's own domain embedding
    assert torch.allclose(adapter(h, domain), torch.tensor([0.0, 2.0]).view(2, 1, 1).expand(2, 5, 32))
    with torch.no_grad():
        adapter.gate.bias.fill_(0.0)
        adapter.gate.weight.zero_()  # half open: the average of the two
    assert torch.allclose(adapter(h, domain), 0.5 * h + torch.tensor([0.0, 1.0]).view(2, 1, 1))


def test_a_domain_adapted_stream_needs_its_domain():
    model = RefusionModel(RefusionConfig.from_preset("tiny", 64, domains=("a", "b")))
    tokens = torch.randint(64, (2, 12))
    _, loss = model(tokens, tokens, domain=torch.tensor([0, 1]))
    loss.backward()
    assert model.diffuser.adapter.embedding.weight.grad.abs().sum() > 0  # the domain embeddings learn
    with pytest.raises(DiffarError, match="choose one"):
        model(tokens, tokens)
    with pytest.raises(DiffarError, match="domains must differ"):
        RefusionConfig.from_preset("tiny", 64, domains=("a", "a"))


PROMPT = "In the beginning God created the heaven and the earth."


def test_domain_adapted_refusion_trains_and_decodes_losslessly(domain_refusion, tiny_run):
    assert read_meta(domain_refusion)["model"]["domains"] == ["kjv2web", "web2rv"]
    ar = run_cli("generate", "--checkpoint", tiny_run, "--prompt", PROMPT, "--max-new-tokens", "24")
    assert ar.returncode == 0, ar.stderr
    for domain in ("kjv2web", "web2rv"):
        proc = run_cli("generate", "--checkpoint", domain_refusion, "--prompt", PROMPT, "--max-new-tokens", "24",
                       "--domain", domain)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ar.stdout  # the AR stream's text, whichever domain drafted it


@pytest.mark.parametrize("flags, message", [
    ((), "drafts for the domains kjv2web, web2rv"),
    (("--domain", "shakespeare"), "unknown domain 'shakespeare'"),
])
def test_decoding_without_a_known_domain_is_a_clean_error(domain_refusion, flags, message):
    proc = run_cli("generate", "--checkpoint", domain_refusion, "--prompt", PROMPT, "--max-new-tokens", "4", *flags)
    assert_clean_error(proc, message)


def test_domain_flags_where_they_do_not_apply(tiny_run, tiny_refusion, tmp_path):
    proc = run_cli("generate", "--checkpoint", tiny_run, "--prompt", PROMPT, "--domain", "kjv2web")
    assert_clean_error(proc, "--domain: not read by --method ar")
    proc = run_cli("generate", "--checkpoint", tiny_refusion, "--prompt", PROMPT, "--domain", "kjv2web")
    assert_clean_error(proc, "no domains")
    proc = run_cli("train", "refusion", "--drafter", "block", "--domain-adapter", "--ar", tiny_run, "--corpus",
                   "kjv2web", "--out", tmp_path / "x")
    assert_clean_error(proc, "--domain-adapter apply to the embedding drafter only")


def test_the_server_takes_a_domain_per_request(domain_refusion, tiny_run):
    with serving(tiny_run) as url:
        ar = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                        timeout=60).json()
    with serving(domain_refusion) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["domains"] == ["kjv2web", "web2rv"]
        for domain in ("kjv2web", "web2rv"):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "domain": domain})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ar["choices"][0]["text"]
        for body in ({}, {"domain": "shakespeare"}):
            r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "domain"


def test_an_adapter_is_added_to_a_trained_stream(tiny_refusion, domain_refusion, tmp_path):
    """--init a stream without one, --domain-adapter: the stream's weights carry over and the adapter starts nearly
    closed; a stream adapted to some domains cannot be continued for others."""
    out = tmp_path / "added"
    proc = run_cli("train", "refusion", "--corpus", "kjv2web,web2rv", "--domain-adapter", "--init", tiny_refusion,
                   "--out", out, "--max-steps", "1", "--block-size", "128", *TINY_TRAIN)
    assert proc.returncode == 0, proc.stderr
    assert read_meta(out)["model"]["domains"] == ["kjv2web", "web2rv"]
    proc = run_cli("train", "refusion", "--corpus", "kjv2web,rv1909", "--domain-adapter", "--init", domain_refusion,
                   "--out", tmp_path / "other", "--max-steps", "1", *TINY_TRAIN)
    assert_clean_error(proc, "cannot serve other domains")
