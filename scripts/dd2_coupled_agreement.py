"""Does a coupled DD2 generator write the teacher's sample for its noise? (valid split only)

    .venv/bin/python scripts/dd2_coupled_agreement.py --checkpoint runs/dd2-coupled-16 \
        --teacher checkpoints/ar-shakespeare

For each valid prompt, a canvas noise z: the teacher samples its continuation for z's first latent channel
(`token_noise`, at the checkpoint's teacher temperature and top-p: what `distill dd2 --coupled` trains on), and
the generator writes one step from z. Printed: the share of canvas slots where the generator agrees with the
teacher's sample for the same noise, with its sample for another noise z' (a generator that ignores its noise
agrees with both alike: the gap is what it learnt of the coupling), over all slots and at slot 0 (whose
teacher token depends on the prompt and one noise value alone), and the teacher's two samples with each other
(how much any two samples share).
"""

from __future__ import annotations

import argparse

import torch

from diffar.checkpoint import load_ar, load_checkpoint
from diffar.data.batching import canvas_examples
from diffar.data.corpora import load_corpus
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import dd2_generate
from diffar.decoding.sampling import SamplingConfig
from diffar.errors import DiffarError
from diffar.evaluation.metrics import slot_agreement
from diffar.models.dd2 import token_noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a coupled continuation DD2 checkpoint or run folder")
    parser.add_argument("--teacher", required=True, help="the AR teacher it was distilled from")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tok, meta = load_checkpoint(args.checkpoint)
    cfg = model.config
    if not cfg.coupled or cfg.eos_id is not None:
        raise DiffarError(f"{args.checkpoint} is not a coupled continuation DD2 generator")
    teacher = load_ar(args.teacher, tok, "--teacher")
    prompt_len, canvas = cfg.vqvae.prompt_len, cfg.vqvae.target_len
    pairs = canvas_examples(load_corpus(meta["corpus"], "valid"), tok, prompt_len, canvas, stride=prompt_len)
    sources = [src for src, _ in pairs[::max(1, len(pairs) // args.prompts)][:args.prompts]]
    generator = torch.Generator().manual_seed(args.seed)
    z, other = (torch.randn(len(sources), canvas, cfg.vqvae.d_latent, generator=generator) for _ in range(2))
    sampling = SamplingConfig(temperature=cfg.teacher_temperature, top_p=cfg.teacher_top_p)

    def teacher_sample(noise: torch.Tensor) -> list[list[int]]:
        return generate(teacher, sources, canvas, pad_id=tok.pad_id, eos_id=None, sampling=sampling,
                        noise=token_noise(noise)).tokens

    mine = dd2_generate(model, sources, canvas, pad_id=tok.pad_id, noise=z).tokens
    same, different = teacher_sample(z), teacher_sample(other)
    flat = [t for row in mine for t in row]
    top = max(set(flat), key=flat.count)

    def first(rows: list[list[int]]) -> list[list[int]]:
        return [row[:1] for row in rows]

    print(f"{args.checkpoint} (step {meta.get('step')}): {len(sources)} valid prompts, {canvas}-token canvases, "
          f"one step; slot agreement with the teacher's sample for the same noise {slot_agreement(mine, same):.3f} "
          f"(slot 0: {slot_agreement(first(mine), first(same)):.3f}), for another noise "
          f"{slot_agreement(mine, different):.3f} (slot 0: {slot_agreement(first(mine), first(different)):.3f}); "
          f"the teacher's two samples {slot_agreement(same, different):.3f}; most common token "
          f"{tok.decode([top])!r} ({flat.count(top) / len(flat):.2f})")


if __name__ == "__main__":
    main()
