"""Inference precision, device and compilation: --device cuda without CUDA is a one-line error; the packed
linear layers (bf16 and fp32) compute what F.linear does and survive moves and casts; int8 (weight-only) stays close
to fp32; compiled decoding passes (plain AR's, draft-and-verify's) write what the eager ones do."""

from __future__ import annotations

import pytest
import torch

from diffar.checkpoint import load_checkpoint, load_for_inference
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.errors import DiffarError
from diffar.generation import OptionError, Options, load_method
from diffar.models.int8_linear import Int8Linear
from diffar.models.packed_linear import PackedLinear, can_pack, pack_linears
from diffar.models.precision import model_device, place, resolve_device
from tests.conftest import assert_clean_error, random_model, run_cli

SHIPPED = "checkpoints/ar-kjv2web"


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DiffarError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DiffarError, match="unknown device"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", [("generate", "--prompt", "And God said"), ("bench", "ar", "--out", "x.json"),
                                     ("chat",), ("distill", "data", "--source", "corpus", "--examples", "1",
                                                 "--out", "x.jsonl")])
def test_cli_device_cuda_without_cuda(command, tmp_path):
    proc = run_cli(*command, "--checkpoint", SHIPPED, "--device", "cuda", env={"HOME": str(tmp_path)})
    assert_clean_error(proc, "no CUDA device")


def test_int8_is_cpu_only_and_unknown_dtypes_are_refused():
    with pytest.raises(DiffarError, match="unknown dtype"):
        place(random_model(0), "int4")
    assert model_device(place(random_model(0), "int8")) == torch.device("cpu")


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU")
def test_packed_bf16_linears_compute_what_f_linear_does():
    plain = random_model(0).bfloat16()
    packed = pack_linears(random_model(0).bfloat16())
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.weight is packed.tok_emb.weight  # still tied
    ids = torch.randint(0, 512, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids)[0], plain(ids)[0], rtol=0.02, atol=0.05)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    assert generate(packed, prompts, 16, pad_id=0, eos_id=None).tokens == \
        generate(plain, prompts, 16, pad_id=0, eos_id=None).tokens


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN on this CPU")
def test_fp32_is_packed_and_writes_f_linears_greedy_text():
    plain, packed = random_model(0), place(random_model(0), "fp32")
    assert isinstance(packed.blocks[0].ffn.gate_up, PackedLinear) and packed.lm_head.weight.dtype == torch.float32
    ids = torch.randint(0, 512, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids)[0], plain(ids)[0])
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    assert generate(packed, prompts, 24, pad_id=0, eos_id=None).tokens == \
        generate(plain, prompts, 24, pad_id=0, eos_id=None).tokens


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN on this CPU")
def test_a_packed_layer_moved_or_cast_packs_again_or_multiplies_plainly():
    """`.to` on a packed model (a trainer moving a frozen target to its device) must not reach the oneDNN copy:
    the weight moves and is packed again where it can be, else the layer falls back to F.linear."""
    model, x = place(random_model(0), "fp32"), torch.randint(0, 512, (2, 9))
    half = model.to(torch.float16)
    assert half.lm_head.packed is None and half.lm_head.weight.dtype == torch.float16
    with torch.no_grad():
        torch.testing.assert_close(half(x)[0], random_model(0).half()(x)[0])
        back = half.float()
        assert back.lm_head.packed is not None and back.lm_head.packed.dtype == torch.float32
        assert back(x)[0].dtype == torch.float32


def test_int8_stays_close_to_fp32_on_a_shipped_model():
    """Teacher-forced over kjv2web test sources: int8's next-token choice agrees with fp32's at
    nearly every position, and its log-likelihood of the text is within 2 %."""
    fp32, tok, _ = load_checkpoint(SHIPPED)
    int8, _, _ = load_for_inference(SHIPPED, dtype="int8")
    assert isinstance(int8.blocks[0].attn.qkv, Int8Linear) and int8.blocks[0].attn.qkv.weight_int8.dtype == torch.int8
    pairs = load_corpus("kjv2web", "test").pairs[:8]
    ids = torch.tensor([tok.encode(p.source)[:24] for p in pairs if len(tok.encode(p.source)) >= 24])
    with torch.no_grad():
        a, b = fp32(ids)[0].log_softmax(-1), int8(ids)[0].log_softmax(-1)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)
    nll_a = -a[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    nll_b = -b[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    assert abs(nll_b - nll_a) / nll_a < 0.02, (float(nll_a), float(nll_b))


def test_compiled_decoding_is_the_eager_decoding(tiny_run, tiny_refusion):
    """--compile: the compiled step writes the eager decoder's greedy text, row for row as run alone in a batch
    of 3 (padded to 4 rows, the padding dropped); once warm, new lengths make no new graphs; a compiled
    method refuses the decoders it does not compile (the uncached one, an embedding diffusion stream's)."""
    eager = load_method(str(tiny_run))
    compiled = load_method(str(tiny_run), compile=True)
    assert compiled.label == "ar-compile" and compiled.model.decode is not eager.model.decode
    settings = eager.settings(Options())
    prompts = [eager.prompt(t) for t in ("In the beginning", "And God said, Let there be light", "Jesus wept")]

    def same(batch: list[list[int]], budget: int) -> None:
        expected = eager.generate(batch, budget, settings, ignore_eos=True)
        got = compiled.generate(batch, budget, settings, ignore_eos=True)
        assert got.tokens == expected.tokens and len(got.tokens) == len(batch) and got.ended == expected.ended

    for batch, budget in (([prompts[0]], 12), ([prompts[1]], 20), (prompts, 16)):
        same(batch, budget)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch, budget in (([prompts[2]], 30), (prompts, 24), (prompts[1:], 9)):  # longer caches, batch 2
        same(batch, budget)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # batch 2 only
    with pytest.raises(OptionError, match="compile applies to KV-cached decoding"):
        load_method(str(tiny_run), compile=True, use_cache=False)
    with pytest.raises(OptionError, match="not to an embedding diffusion stream"):
        load_method(str(tiny_refusion), compile=True)


def test_compiled_draft_and_verify_is_greedy_ar(tiny_run):
    """--compile with a drafter: prompt lookup's verification passes and a draft model's own passes compiled write
    the eager greedy AR text, batched (3 rows, padded to 4, the padding dropped), and do make graphs."""
    eager = load_method(str(tiny_run))
    settings = eager.settings(Options())
    prompts = [eager.prompt(t) for t in ("In the beginning", "And God said, Let there be light", "Jesus wept")]
    reference = eager.generate(prompts, 20, settings, ignore_eos=True).tokens
    for drafter in ({"prompt_lookup": True}, {"draft": str(tiny_run)}):
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        method = load_method(str(tiny_run), compile=True, **drafter)
        got = method.generate(prompts, 20, settings, ignore_eos=True)
        assert got.tokens == reference
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
