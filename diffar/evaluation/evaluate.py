"""`diffar eval`: quality of a checkpoint on a corpus split.

VQ-VAE: reconstruction of the split's canvases (token accuracy, exact-sequence rate, code usage).

seq2seq: greedy generation for every source, scored with BLEU-4, chrF and ROUGE-L against the
references, next to the copy-the-source baseline; plus teacher-forced perplexity of the references.
continuation: perplexity of the split.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from tqdm import tqdm

from diffar.checkpoint import ar_stream, load_for_inference
from diffar.data.batching import CanvasDataset, build_dataset, canvas_examples
from diffar.data.corpora import checkpoint_corpus
from diffar.errors import DiffarError
from diffar.evaluation.hardware import cpu_name
from diffar.evaluation.metrics import mean_nll, perplexity, text_metrics
from diffar.generation import ARMethod, Options
from diffar.models.vqvae import TextVQVAE


@torch.inference_mode()
def translate(method: ARMethod, sources: list[str], batch_size: int) -> tuple[list[str], float, int]:
    """Greedy-decode every source (length-sorted batches); returns (outputs, seconds, new tokens)."""
    ids = [method.prompt(s) for s in sources]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    outputs: list[str] = [""] * len(ids)
    seconds, new_tokens = 0.0, 0
    greedy = method.settings(Options())
    for i in tqdm(range(0, len(order), batch_size), desc="translating", unit="batch", dynamic_ncols=True,
                  disable=len(order) <= batch_size):
        rows = order[i:i + batch_size]
        longest = max(len(ids[r]) for r in rows)
        budget = min(method.room(ids[rows[-1]]), 2 * longest + 16)
        if budget <= 0:
            raise DiffarError(f"a source of {longest} tokens leaves no room in the "
                              f"{method.model.config.max_seq_len}-token context")
        result = method.generate([ids[r] for r in rows], budget, greedy)
        seconds, new_tokens = seconds + result.seconds, new_tokens + result.new_tokens
        for r, toks in zip(rows, result.tokens):
            outputs[r] = method.tokenizer.decode(toks).strip()
    return outputs, seconds, new_tokens


@torch.inference_mode()
def reconstruction(vqvae: TextVQVAE, tokenizer, corpus, limit: int | None, batch_size: int) -> dict:
    """How well the autoencoder gives back the split's canvases: token accuracy over the text and its <eos>
    (and over every position, pads included), the share of canvases rebuilt exactly, and code usage."""
    cfg = vqvae.config
    seq2seq = corpus.task == "seq2seq"
    pairs = canvas_examples(corpus, tokenizer, cfg.prompt_len, cfg.target_len, stride=cfg.target_len)
    data = CanvasDataset(pairs[:limit] if limit else pairs, tokenizer,
                         cfg.width if seq2seq else (lambda n: cfg.target_len), cfg.max_len, eos=seq2seq,
                         with_source=False)
    text_right = text_total = all_right = all_total = exact = 0
    codes = []
    for start in range(0, len(data), batch_size):
        targets = data.batch(list(range(start, min(start + batch_size, len(data)))))["targets"]
        z, code, _ = vqvae.quantize(targets)
        right = vqvae.decode(z).argmax(-1) == targets
        text = targets != tokenizer.pad_id
        text_right, text_total = text_right + int((right & text).sum()), text_total + int(text.sum())
        all_right, all_total = all_right + int(right.sum()), all_total + right.numel()
        exact += int((right | ~text).all(1).sum())
        if code is not None:
            codes.append(code.flatten(0, 1))
    report = {"canvases": len(data), "token_accuracy": round(text_right / text_total, 5),
              "token_accuracy_with_pads": round(all_right / all_total, 5),
              "exact_sequence_rate": round(exact / len(data), 4)}
    if codes:
        report["code_usage"] = round(vqvae.bottleneck.usage(torch.cat(codes)), 4)
    return report


def evaluate_checkpoint(checkpoint: str, corpus_name: str | None, split: str, limit: int | None,
                        batch_size: int, block_size: int | None = None, dtype: str = "fp32") -> dict:
    """`block_size`: the perplexity window of a continuation model (default: its training block, else its
    context); `dtype`: the inference precision (fp32, bf16, int8), so that its quality cost is measured."""
    model, tokenizer, meta = load_for_inference(checkpoint, dtype=dtype)
    corpus = checkpoint_corpus(meta, corpus_name, split)
    report = {"checkpoint": str(checkpoint), "corpus": corpus.name, "split": split, "task": corpus.task,
              "device": cpu_name(), "torch_threads": torch.get_num_threads(), "dtype": dtype}
    if meta["kind"] == "vqvae":
        return {**report, **reconstruction(model, tokenizer, corpus, limit, batch_size)}
    if meta["kind"] == "dd2":
        raise DiffarError("a DD2 checkpoint is measured with `diffar bench dd2` (quality and speed side by side)")
    model = ar_stream(model)  # a ReFusion model's text is its AR stream's (lossless decoding)
    if corpus.task == "seq2seq":
        pairs = corpus.pairs[:limit] if limit else corpus.pairs
        sources, references = [p.source for p in pairs], [p.target for p in pairs]
        t0 = time.perf_counter()
        outputs, gen_seconds, new_tokens = translate(ARMethod(model, tokenizer, corpus.task), sources, batch_size)
        report.update(examples=len(pairs), model=text_metrics(outputs, references),
                      copy_source_baseline=text_metrics(sources, references),
                      generation_seconds=round(gen_seconds, 2), new_tokens=new_tokens,
                      tokens_per_s=round(new_tokens / gen_seconds, 1), batch_size=batch_size,
                      wall_seconds=round(time.perf_counter() - t0, 2),
                      samples=[{"source": s, "reference": r, "output": o}
                               for s, r, o in list(zip(sources, references, outputs))[:3]])
        dataset = build_dataset(dataclasses.replace(corpus, pairs=pairs), tokenizer, model.config.max_seq_len)
        nll = mean_nll(model, dataset, batch_size, progress=True)
    else:
        block = block_size or meta.get("block_size", model.config.max_seq_len)
        if block > model.config.max_seq_len:
            raise DiffarError(f"a window of {block} tokens exceeds the model's context of {model.config.max_seq_len}")
        dataset = build_dataset(corpus, tokenizer, block)
        report.update(block_size=block, windows=len(dataset.eval_indices(limit or len(dataset))))
        nll = mean_nll(model, dataset, batch_size, limit, progress=True)
    report.update(nll=round(nll, 4), perplexity=round(perplexity(nll), 3))
    return report
