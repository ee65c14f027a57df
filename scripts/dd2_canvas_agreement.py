"""Does a continuation DD2 generator fail on its own text or on any prompt? (valid split only)

    .venv/bin/python scripts/dd2_canvas_agreement.py --checkpoint runs/dd2-shakespeare-e1 --ar checkpoints/ar-shakespeare

Samples canvas after canvas from valid prompts, as `dd2_generate` does for long outputs, and scores each
one-step canvas against the AR teacher's greedy continuation of the *same* prompt (same token at the same
slot). Beside each canvas, the generator is also given the prompt extended by the teacher's own text
instead of its own: if the canvases after the first fail only on their own text (exposure bias), this
second score stays at the first canvas's level while the first falls.
"""

from __future__ import annotations

import argparse

import torch

from diffar.checkpoint import load_ar, load_checkpoint
from diffar.data.batching import canvas_examples
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import dd2_generate
from diffar.evaluation.metrics import slot_agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a continuation DD2 checkpoint or run folder")
    parser.add_argument("--ar", required=True, help="the AR teacher")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--canvases", type=int, default=4)
    args = parser.parse_args()
    model, tok, meta = load_checkpoint(args.checkpoint)
    ar = load_ar(args.ar, tok, "--ar")
    prompt_len, canvas = model.config.vqvae.prompt_len, model.config.vqvae.target_len
    pairs = canvas_examples(load_corpus(meta["corpus"], "valid"), tok, prompt_len, canvas, stride=prompt_len)
    prompts = [src for src, _ in pairs[::max(1, len(pairs) // args.prompts)][:args.prompts]]
    generator = torch.Generator().manual_seed(0)

    def one_step(texts: list[list[int]]) -> list[list[int]]:
        return dd2_generate(model, [t[-prompt_len:] for t in texts], canvas, generator=generator).tokens

    def teacher(texts: list[list[int]]) -> list[list[int]]:
        return generate(ar, [t[-prompt_len:] for t in texts], canvas, pad_id=tok.pad_id, eos_id=None).tokens

    print(f"{args.checkpoint}: {len(prompts)} valid prompts, canvases of {canvas} tokens, one step each")
    print("canvas | agreement on its own text | on the teacher's text | most common token (share)")
    own = taught = prompts
    for k in range(args.canvases):
        mine, reference = one_step(own), teacher(own)
        on_teacher = slot_agreement(one_step(taught), teacher(taught))
        flat = [t for row in mine for t in row]
        top = max(set(flat), key=flat.count)
        print(f"{k:6d} | {slot_agreement(mine, reference):25.3f} | {on_teacher:21.3f} | "
              f"{tok.decode([top])!r} ({flat.count(top) / len(flat):.2f})")
        own = [t + m for t, m in zip(own, mine)]
        taught = [t + r for t, r in zip(taught, teacher(taught))]


if __name__ == "__main__":
    main()
