"""What the serving engine needs to know about a decoding method: how a prompt becomes the model's input,
how many new tokens that input leaves room for, whether requests fit one batch, and how a batch is decoded
(each row's tokens go to its request through `Request.push`, which applies budgets and stop strings).

- `ARMethod`: KV-cached AR decoding; tokens reach the requests as they are produced.
- `RefusionMethod`: ReFusion's lossless decoding (the diffusion stream drafts blocks, the AR stream verifies
  them); the AR stream's prompt, room and pins, and tokens reach the requests block by block.
- `DD2Method`: DD2 sampling (one step by default, or a request's `steps` / `preset`; pins kept in the
  latent canvas); every row's text is ready after the last denoising step, so a stream gets it in one
  burst, after (with several steps) a snapshot of the whole text after each step. A request's `best_of`
  samples are drawn and one kept (`best_of_generate`): the likeliest under the server's `judge` (an AR
  model), or without one by the decoder's own confidence.
"""

from __future__ import annotations

import torch

from diffar.data.batching import ar_prompt, prompt_ids
from diffar.decoding.ar import generate
from diffar.decoding.dd2 import DD2Sampling, best_of_generate, dd2_generate
from diffar.decoding.refusion import refusion_generate
from diffar.tokenizer import Tokenizer


class ARMethod:
    name = "ar"

    def __init__(self, model, tokenizer: Tokenizer, task: str):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.context = model.config.max_seq_len

    def prompt(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, self.task, text)

    def room(self, ids: list[int]) -> int:
        return self.context - len(ids)

    def fits(self, longest_prompt: int, budget: int) -> bool:
        """Whether rows with these longest prompt and largest budget share one cache."""
        return longest_prompt + budget <= self.context

    def decode(self, batch: list, generator: torch.Generator | None) -> None:
        tok = self.tokenizer
        result = generate(self.model, [r.prompt_ids for r in batch], max(r.max_tokens for r in batch),
                          pad_id=tok.pad_id, eos_id=tok.eos_id, sampling=batch[0].sampling,
                          on_token=lambda row, token: batch[row].push(token, tok), generator=generator,
                          fixed=[r.fixed for r in batch])
        report(batch, {"forward_passes": result.forward_passes})


class RefusionMethod(ARMethod):
    name = "refusion"

    def __init__(self, model, tokenizer: Tokenizer, task: str):
        super().__init__(model.ar, tokenizer, task)
        self.refusion = model

    def decode(self, batch: list, generator: torch.Generator | None) -> None:
        tok = self.tokenizer
        result = refusion_generate(self.refusion, [r.prompt_ids for r in batch], max(r.max_tokens for r in batch),
                                   eos_id=tok.eos_id, sampling=batch[0].sampling, generator=generator,
                                   on_token=lambda row, token: batch[row].push(token, tok),
                                   fixed=[r.fixed for r in batch])
        report(batch, {"ar_passes": result.target_passes, "diffusion_passes": result.draft_passes,
                       "drafts_accepted": round(result.accepted / result.drafted, 3) if result.drafted else None})


CONTINUATION_ROOM = 1024  # the most new tokens a request to a continuation DD2 model may ask for


class DD2Method:
    name = "dd2"

    def __init__(self, model, tokenizer: Tokenizer, task: str, judge=None):
        self.model, self.tokenizer, self.task, self.judge = model, tokenizer, task, judge
        self.vq = model.config.vqvae

    def prompt(self, text: str) -> list[int]:
        """The source a DD2 model reads: the whole text (seq2seq) or its last `prompt_len` tokens."""
        ids = self.tokenizer.encode(text)
        return ids if self.task == "seq2seq" else ids[-self.vq.prompt_len:]

    def room(self, ids: list[int]) -> int:
        """seq2seq: the canvas width (`DD2Config.canvas_width`), none for a source longer than the model
        reads; continuation: CONTINUATION_ROOM tokens, sampled canvas after canvas."""
        cfg = self.model.config
        if self.task == "continuation":
            return CONTINUATION_ROOM
        return cfg.canvas_width(len(ids)) if len(ids) <= cfg.max_source_len else 0

    def fits(self, longest_prompt: int, budget: int) -> bool:
        return True  # each row has its own canvas; room() has bounded both already

    def judge_prompt(self, ids: list[int]) -> list[int]:
        """What the judge reads before a sample: the source the generator reads, plus <sep> for seq2seq."""
        return ar_prompt(self.tokenizer, self.task, ids)

    def judge_room(self, ids: list[int]) -> int:
        """The most tokens a sample may have for the judge to score it after `judge_prompt(ids)` (its <eos>
        aside: the judge never reads a text's last token)."""
        return self.judge.config.max_seq_len - len(self.judge_prompt(ids))

    def decode(self, batch: list, generator: torch.Generator | None) -> None:
        tok = self.tokenizer

        def on_step(i: int, rows: list[list[int]]) -> None:
            for request, tokens in zip(batch, rows):
                request.snapshot(i + 1, tokens, tok)

        sources, budget, sampling = [r.prompt_ids for r in batch], max(r.max_tokens for r in batch), batch[0].sampling
        decode = dict(sampling=sampling, eos_id=tok.eos_id if self.task == "seq2seq" else None, pad_id=tok.pad_id,
                      generator=generator, fixed=[r.fixed for r in batch])
        if sampling.best_of > 1:  # never streamed (the app refuses it)
            result = best_of_generate(self.model, self.judge, sources, list(map(self.judge_prompt, sources)), budget,
                                      **decode)
        else:
            streaming = any(r.stream for r in batch)  # a snapshot costs a decoder pass per step
            result = dd2_generate(self.model, sources, budget, on_step=on_step if streaming else None, **decode)
        for request, tokens in zip(batch, result.tokens):
            for token in tokens:
                if not request.push(token, tok):
                    break
        judge_passes = 1 if sampling.best_of > 1 and self.judge is not None else 0  # among the forward passes
        report(batch, {"steps": result.steps, "denoiser_passes": result.forward_passes - judge_passes,
                       "decoder_passes": result.decoder_passes} | ({"judge_passes": 1} if judge_passes else {}))


def report(batch: list, passes: dict) -> None:
    """Give every request of a batch the forward passes the batch took (the response's `diffar` object)."""
    for request in batch:
        request.passes = {**passes, "batch_size": len(batch)}


def dd2_sampling(steps: int | None, guidance_scale: float | None, preset: str | None, best_of: int = 1,
                 tau: float | None = None, tau_min: float | None = None) -> DD2Sampling:
    """A request's DD2 sampling: a preset with its overrides, or one step, guidance 1 and an argmax read-out
    by default."""
    if preset:
        return DD2Sampling.from_preset(preset, steps=steps, guidance_scale=guidance_scale, best_of=best_of,
                                       tau_max=tau, tau_min=tau_min)
    return DD2Sampling(steps=steps or 1, guidance_scale=1.0 if guidance_scale is None else guidance_scale,
                       best_of=best_of, tau_max=tau or 0.0, tau_min=tau_min or 0.0)
