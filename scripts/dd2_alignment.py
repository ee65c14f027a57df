"""Where a one-step DD2 generator loses BLEU against its AR teacher on kjv2web (valid split only).

    .venv/bin/python scripts/dd2_alignment.py [--checkpoint checkpoints/dd2-kjv2web] [--verses 256]

Prints one-step BLEU-4 against the references; the teacher's (greedy AR); the canvas cut at the teacher's
length instead of at its own end (is the length the problem?); one step against the teacher's text (its
target); and, per bucket of 8 positions, how often the canvas holds the teacher's token at the same
position (do errors grow along the text?).
"""

from __future__ import annotations

import argparse

import torch

from diffar.checkpoint import load_checkpoint
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import dd2_generate
from diffar.evaluation.metrics import text_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/dd2-kjv2web")
    parser.add_argument("--teacher", default="checkpoints/ar-kjv2web")
    parser.add_argument("--verses", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    model, tok, _ = load_checkpoint(args.checkpoint)
    teacher, _, _ = load_checkpoint(args.teacher)
    pairs = load_corpus("kjv2web", "valid").pairs[:args.verses]
    sources, references = [tok.encode(p.source) for p in pairs], [p.target for p in pairs]
    ended, canvases, taught = [], [], []
    with torch.inference_mode():
        for i in range(0, len(sources), args.batch_size):
            batch = sources[i:i + args.batch_size]
            for eos, out in ((tok.eos_id, ended), (None, canvases)):  # the same noise: the text, the canvas
                out += dd2_generate(model, batch, 256, eos_id=eos, pad_id=tok.pad_id,
                                    generator=torch.Generator().manual_seed(i)).tokens
            taught += generate(teacher, [s + [tok.sep_id] for s in batch], 2 * max(map(len, batch)) + 16,
                               pad_id=tok.pad_id, eos_id=tok.eos_id).tokens

    def bleu(outputs: list[list[int]], against: list[str] = references) -> float:
        return text_metrics([tok.decode(o).strip() for o in outputs], against)["bleu4"]

    print(f"one step: BLEU-4 {bleu(ended):.2f}; teacher: {bleu(taught):.2f}; one-step canvas cut at the "
          f"teacher's length: {bleu([c[:len(t)] for c, t in zip(canvases, taught)]):.2f}; one step against "
          f"the teacher's text: {bleu(ended, [tok.decode(t).strip() for t in taught]):.2f}")
    shorter = sum(len(e) < len(t) for e, t in zip(ended, taught)) / len(taught)
    print(f"one-step text shorter than the teacher's: {shorter:.0%}")
    buckets: dict[int, list[bool]] = {}
    for canvas, text in zip(canvases, taught):
        for j, token in enumerate(text):
            buckets.setdefault(j // 8 * 8, []).append(j < len(canvas) and canvas[j] == token)
    print("same token as the teacher at the same position, by position:",
          ", ".join(f"{k}-{k + 7}: {sum(v) / len(v):.0%}" for k, v in sorted(buckets.items()) if len(v) >= 20))


if __name__ == "__main__":
    main()
