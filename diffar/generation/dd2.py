"""DD2 as a generation method: noise -> clean latent canvas in one step (or a few) -> every token in one
decoder pass (lossy). Optionally the best of n samples, kept by an AR `judge` (or the decoder's own
confidence), or hybrid: a DD2 prefix that an AR model continues (the DD2 seed post's hybrid sampling)."""

from __future__ import annotations

from diffar.data.batching import ar_prompt
from diffar.decoding.dd2 import DD2Sampling, best_of_generate, dd2_generate, hybrid_generate
from diffar.decoding.result import DIFFUSION, GenerationResult, written_by
from diffar.generation.method import Options, OptionError, per_row
from diffar.models.dd2 import DD2Model
from diffar.models.transformer import Transformer
from diffar.tokenizer import Tokenizer

CONTINUATION_ROOM = 1024  # the most new tokens a continuation DD2 model is asked for, sampled canvas after canvas


class DD2Method:
    name = "dd2"
    options = frozenset({"steps", "guidance_scale", "preset", "tau", "tau_min", "sampler", "adaptive", "best_of"})
    domains: tuple[str, ...] = ()

    def __init__(self, model: DD2Model, tokenizer: Tokenizer, task: str, *, judge: Transformer | None = None,
                 hybrid: Transformer | None = None):
        self.model, self.tokenizer, self.task, self.judge, self.hybrid = model, tokenizer, task, judge, hybrid
        self.label = "dd2-hybrid" if hybrid is not None else "dd2"
        self.eos_id = tokenizer.eos_id if task == "seq2seq" else None

    def prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def source(self, ids: list[int]) -> list[int]:
        """What the generator reads of a prompt: a seq2seq source whole, a continuation's last `prompt_len`
        tokens."""
        return ids if self.task == "seq2seq" else ids[-self.model.config.vqvae.prompt_len:]

    def room(self, ids: list[int], settings: DD2Sampling | None = None) -> int:
        """seq2seq: the canvas width (`DD2Config.canvas_width`), none for a source longer than the model reads;
        continuation: CONTINUATION_ROOM. A judge must also be able to score a sample after the source."""
        cfg = self.model.config
        if self.task == "continuation":
            room = CONTINUATION_ROOM
        else:
            room = cfg.canvas_width(len(ids)) if len(ids) <= cfg.max_source_len else 0
        if settings is not None and settings.best_of > 1 and self.judge is not None:
            # the judge never reads a text's last token (its <eos>), hence no - 1
            room = min(room, self.judge.config.max_seq_len - len(self._judged(ids)))
        return room

    def fits(self, longest_prompt: int, budget: int) -> bool:
        return True  # each row has its own canvas; room() has bounded both already

    def settings(self, options: Options) -> DD2Sampling:
        """A preset with its overrides, or else one step, guidance 1 and an argmax read-out."""
        knobs = dict(steps=options.steps, guidance_scale=options.guidance_scale, tau_max=options.tau,
                     tau_min=options.tau_min, sampler=options.sampler, adaptive=options.adaptive or None,
                     best_of=options.best_of)
        if options.preset:
            sampling = DD2Sampling.from_preset(options.preset, **knobs)
        else:
            sampling = DD2Sampling(**{k: v for k, v in {**knobs, "steps": 1 if options.steps is None else options.steps}.items() if v is not None})
        if options.tau is not None and options.tau_min is None and sampling.one_step:
            raise OptionError("tau", "a one-step sample is read out at t = 1, where tau(t) = max(tau_min, tau * (1 - t)) "
                                     "is tau_min: tau needs more steps; give tau_min to sample the one-step read-out")
        if sampling.best_of > 1 and self.hybrid is not None:
            raise OptionError("best_of", "best of n and hybrid sampling do not combine; choose one")
        return sampling

    def _judged(self, ids: list[int]) -> list[int]:
        """What the judge reads before a sample: what the generator reads, plus <sep> for seq2seq."""
        return ar_prompt(self.tokenizer, self.task, self.source(ids))

    def generate(self, prompts: list[list[int]], budgets: int | list[int], settings: DD2Sampling, *,
                 on_token=None, on_step=None, generator=None, fixed=None, ignore_eos: bool = False) -> GenerationResult:
        """`on_step` (multi-step snapshots, one decoder pass each) is honoured by plain sampling; `ignore_eos`
        changes nothing (a continuation canvas has no end, a seq2seq one is as long as it marks)."""
        budgets = per_row(budgets, len(prompts))
        sources = [self.source(p) for p in prompts]
        decode = dict(sampling=settings, eos_id=self.eos_id, pad_id=self.tokenizer.pad_id, generator=generator)
        if self.hybrid is not None:
            result = hybrid_generate(self.model, self.hybrid, sources,
                                     [ar_prompt(self.tokenizer, self.task, p) for p in prompts], max(budgets), **decode)
        elif settings.best_of > 1:
            result = best_of_generate(self.model, self.judge, sources, list(map(self._judged, prompts)), max(budgets),
                                      fixed=fixed, **decode)
        else:
            result = dd2_generate(self.model, sources, max(budgets), on_step=on_step, fixed=fixed, **decode)
        origins = result.origins or written_by(result.tokens, DIFFUSION, fixed)  # hybrid: its AR's too
        for row, tokens in enumerate(result.tokens):  # every row's text is ready at once: hand it over
            result.tokens[row] = tokens = tokens[:budgets[row]]
            for i, token in enumerate(tokens):
                if on_token is not None and on_token(row, token, origins[row][i]) is False:
                    result.tokens[row] = tokens[:i + 1]
                    break
        result.origins = [o[:len(t)] for o, t in zip(origins, result.tokens)]
        return result

    def describe(self, result: GenerationResult, settings: DD2Sampling) -> tuple[str, str]:
        """(label, account of the passes) of a one-row result, for the speed line."""
        steps = result.extra["steps"]
        if self.hybrid is not None:
            label = f"dd2-hybrid, {steps}-step prefix"
        else:
            judge = "AR judge" if self.judge is not None else "decoder"
            label = f"dd2 {steps}-step {settings.sampler}" + (
                f", best of {settings.best_of} by the {judge}" if settings.best_of > 1 else "")
        n, passes = result.new_tokens, result.forward_passes
        return label, (f"{passes} forward passes ({n / passes:.2f} tokens/pass), {result.passes['decoder']} decoder "
                       f"passes | guidance {settings.guidance_scale}, tau {result.extra['tau']:.3g}")
