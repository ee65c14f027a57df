"""DD2 sampling: noise -> (1..N denoising steps) -> clean latent canvas -> every token in one decoder pass.

`dd2_generate` runs a scheduler (DDIM or DDPM, diffusion/scheduler.py) over the latent canvas of each
source, with classifier-free guidance, then reads the tokens out of the last z0 prediction. Tokens read out of
a prediction made at time t use the dynamic temperature of the DD2 seed post (seeds/dd2.zh.txt)
    tau(t) = max(tau_min, tau_max * (1 - t))          (t in [0, 1]; tau 0 = argmax)
so a one-step sample (t = 1) decodes at tau_min and many-step samples end near tau_max.

Sampling policies from the same post (sections 5.2 and 6): presets `speed` (30 steps, tau 0.7, guidance 1.5) and
`quality` (100 steps, tau 0.3, guidance 2.0); adaptive steps min(100, 50 + length // 10); and hybrid
sampling for long outputs: one step for the first (up to) 50 tokens, then an AR model continues that prefix
with its KV cache (`hybrid_generate`). Best of n (`DD2Sampling.best_of`, `best_of_generate`): n samples
per source from independent noise, and an AR model (or the decoder itself) keeps the likeliest. Pinned
tokens (`Pins`) are written into the latent canvas after every step, and `on_step` watches the text form
step by step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from diffar.data.batching import pad_right
from diffar.decoding.ar import generate, log_likelihoods
from diffar.decoding.result import AR, DIFFUSION, GenerationResult, written_by
from diffar.diffusion.scheduler import SCHEDULERS
from diffar.errors import DiffarError
from diffar.models.dd2 import DD2Model
from diffar.models.transformer import Transformer

PRESETS: dict[str, dict] = {
    "speed": dict(steps=30, tau_max=0.7, guidance_scale=1.5),
    "quality": dict(steps=100, tau_max=0.3, guidance_scale=2.0),
}


@dataclass(frozen=True)
class DD2Sampling:
    steps: int = 1
    adaptive: bool = False  # steps by canvas length instead: min(100, 50 + length // 10)
    sampler: str = "ddim"
    guidance_scale: float = 1.0  # 1: conditional only
    tau_max: float = 0.0
    tau_min: float = 0.0
    best_of: int = 1  # samples per source, of which one is kept (`best_of_generate`)

    def __post_init__(self):
        if self.steps <= 0:
            raise DiffarError(f"the number of denoising steps must be positive, got {self.steps}")
        if self.best_of <= 0:
            raise DiffarError(f"best_of must be >= 1, got {self.best_of}")
        if self.sampler not in SCHEDULERS:
            raise DiffarError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SCHEDULERS)}")
        if not self.guidance_scale >= 0:
            raise DiffarError(f"guidance scale must be >= 0, got {self.guidance_scale}")
        if not (self.tau_max >= 0 and self.tau_min >= 0):
            raise DiffarError("decoding temperatures must be >= 0")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> DD2Sampling:
        if name not in PRESETS:
            raise DiffarError(f"unknown sampling preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})

    def steps_for(self, length: int) -> int:
        return adaptive_steps(length) if self.adaptive else self.steps

    def tau(self, t: float) -> float:
        return max(self.tau_min, self.tau_max * (1 - t))

    @property
    def one_step(self) -> bool:
        """A single denoising step, read out at t = 1, where tau(t) is tau_min and tau_max does nothing."""
        return not self.adaptive and self.steps == 1


def adaptive_steps(length: int) -> int:
    """The seed's step count for a canvas of `length` tokens (section 6)."""
    return min(100, 50 + length // 10)


def dd2_result(tokens: list[list[int]], seconds: float, steps: int, denoiser_passes: int, decoder_passes: int,
               confidence: list[float], tau: float, ended: list[bool]) -> GenerationResult:
    """A DD2 sample as a `GenerationResult`. Its extras: `steps` (denoising steps), `tau` (the temperature
    the tokens were read out at: tau(t) of the last step; one step: tau_min) and `confidence` (per row, the
    mean log-probability the decoder gave the tokens it read out: the text, and for seq2seq the end it
    marked). `ended`: per row, whether a seq2seq canvas marked the text's end (<eos> or <pad>) within its
    width and the budget."""
    return GenerationResult(tokens, seconds, {"denoiser": denoiser_passes, "decoder": decoder_passes}, ended,
                            {"steps": steps, "tau": tau, "confidence": confidence})


def read_tokens(logits: torch.Tensor, tau: float, generator: torch.Generator | None) -> torch.Tensor:
    """Token ids from decoder logits (B, N, V) at temperature tau (0: argmax); drawn on the CPU, where the
    callers' generators live, whatever the logits' device."""
    if tau == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / tau, dim=-1).cpu()
    return torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(probs.shape[:-1]).to(logits.device)


class Pins:
    """Tokens a person pinned (output position -> token, per row), kept in the latent canvas: after every
    denoising step the prediction is decoded, the pins are written into its tokens, and the canvas is
    encoded again, so later steps (and the decoder, which sees the whole canvas) read them as context.
    Before a row's last pin the canvas may not end (<eos> and <pad> are ruled out there)."""

    def __init__(self, fixed: list[dict[int, int]], widths: list[int], end_ids: tuple[int, ...]):
        for row, (pins, width) in enumerate(zip(fixed, widths)):
            if any(not 0 <= pos < width for pos in pins):
                raise DiffarError(f"row {row}: pinned positions must lie within its canvas of {width} tokens")
        self.fixed, self.end_ids = fixed, end_ids
        self.rows = torch.tensor([bool(pins) for pins in fixed]).view(-1, 1, 1)  # rows without pins are left alone

    def guard(self, logits: torch.Tensor) -> torch.Tensor:
        """Decoder logits (B, N, V) with the canvas's end ruled out before each row's last pin."""
        logits = logits.clone()
        for row, pins in enumerate(self.fixed):
            if pins and self.end_ids:
                logits[row, :max(pins), list(self.end_ids)] = float("-inf")
        return logits

    def write(self, ids: torch.Tensor) -> torch.Tensor:
        for row, pins in enumerate(self.fixed):
            for pos, token in pins.items():
                ids[row, pos] = token
        return ids


@torch.inference_mode()
def dd2_generate(model: DD2Model, sources: list[list[int]], max_new: int, *, sampling: DD2Sampling = DD2Sampling(),
                 eos_id: int | None = None, pad_id: int = 0, generator: torch.Generator | None = None,
                 on_step: Callable[[int, list[list[int]]], None] | None = None,
                 fixed: list[dict[int, int]] | None = None, noise: torch.Tensor | None = None) -> GenerationResult:
    """Sample a canvas per source and return its text, at most `max_new` tokens per row.

    seq2seq models (config.eos_id set) size each canvas by the source (`VQVAEConfig.width`; in a batch the
    positions past a row's own width are masked out, so a row never reads its neighbours' canvases, but the
    starting noise is one draw for the batch and adaptive steps follow its widest canvas, so a seeded sample
    can differ between batch sizes) and end each row at its first <eos> or <pad>; continuation models fill
    `target_len` positions, and sample longer outputs canvas after canvas, each reading the last `prompt_len`
    tokens of the prompt and the text so far (semi-autoregressive: one denoising run per canvas).
    `on_step(i, rows)` sees the tokens after denoising step i (for streaming snapshots): the argmax of each
    intermediate prediction, so watching does not draw from `generator` and the result is the same with or
    without it. `fixed[row]` pins output positions to tokens (see `Pins`); the output keeps them, and each
    pinned step costs one more decoder and encoder pass. `noise` (B, N, d_latent) is the starting noise instead
    of a draw from `generator`: a canvas's width of positions, or for continuation canvas after canvas, one
    `target_len` run of positions per canvas (as a coupled distillation's teacher read it, `DD2Config.coupled`)."""
    if max_new <= 0:
        raise DiffarError(f"max_new must be positive, got {max_new}")
    if sampling.best_of > 1:
        raise DiffarError("dd2_generate draws one sample per source; best_of > 1 needs best_of_generate")
    if not sources or any(not s for s in sources):
        raise DiffarError("every source needs at least one token")
    canvas = model.config.vqvae.target_len
    if model.config.eos_id is not None or max_new <= canvas:
        return _sample(model, sources, max_new, sampling, eos_id, pad_id, generator, on_step, fixed, noise)
    if fixed and any(pos >= max_new for pins in fixed for pos in pins):
        raise DiffarError(f"pinned positions must lie within the {max_new} tokens asked for")
    t0 = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in sources]
    log_prob = [0.0] * len(sources)  # summed over the canvases, for the mean confidence
    passes = decoder_passes = 0

    def watch(i: int, rows: list[list[int]]) -> None:
        on_step(i, [done + row for done, row in zip(tokens, rows)])

    for start in range(0, max_new, canvas):
        prompts = [(s + t)[-model.config.vqvae.prompt_len:] for s, t in zip(sources, tokens)]
        pins = fixed and [{pos - start: v for pos, v in row.items() if start <= pos < start + canvas} for row in fixed]
        part = _sample(model, prompts, min(canvas, max_new - start), sampling, eos_id, pad_id, generator,
                       on_step and watch, pins, None if noise is None else noise[:, start:start + canvas])
        tokens = [t + new for t, new in zip(tokens, part.tokens)]
        log_prob = [lp + c * len(new) for lp, c, new in zip(log_prob, part.extra["confidence"], part.tokens)]
        passes, decoder_passes = passes + part.passes["denoiser"], decoder_passes + part.passes["decoder"]
    return dd2_result(tokens, time.perf_counter() - t0, part.extra["steps"], passes, decoder_passes,
                      [lp / len(t) for lp, t in zip(log_prob, tokens)], part.extra["tau"], [False] * len(sources))


def _sample(model: DD2Model, sources: list[list[int]], max_new: int, sampling: DD2Sampling, eos_id: int | None,
            pad_id: int, generator: torch.Generator | None, on_step, fixed, noise) -> GenerationResult:
    """One canvas per source (`dd2_generate`'s arguments)."""
    cfg = model.config
    vq = cfg.vqvae
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    source, mask = pad_right(sources, pad_id)
    source, mask = source.to(device), mask.to(device)
    widths = torch.tensor([cfg.canvas_width(len(s)) for s in sources])
    width = int(widths.max())
    canvas_mask = (torch.arange(width) < widths[:, None]).to(device)
    ends = (eos_id, pad_id) if eos_id is not None else ()
    pins = Pins(fixed, widths.tolist(), ends) if fixed and any(fixed) else None
    steps = sampling.steps_for(width)
    scheduler = SCHEDULERS[sampling.sampler](model.schedule, prediction=cfg.prediction)
    scheduler.set_timesteps(steps)
    dtype = next(model.denoiser.parameters()).dtype  # the network's; the sample and the scheduler's math stay fp32
    shape = (len(sources), width, vq.d_latent)
    if noise is not None and tuple(noise.shape) != shape:
        raise DiffarError(f"noise must be (rows, canvas positions, latent width) = {shape}, got {tuple(noise.shape)}")
    z = (torch.randn(shape, generator=generator) if noise is None else noise.float()).to(device)
    states = model.encode_source(source)  # the source encoder's read, made once for every step
    passes = decoder_passes = 0
    for i, t in enumerate(scheduler.timesteps.tolist()):
        out = model.predict(z.to(dtype), torch.full((len(z),), t, device=device), source, mask,
                            sampling.guidance_scale, canvas_mask, states).float()
        passes += 1
        if pins is not None:
            ids = pins.write(pins.guard(model.decode(scheduler.x0_hat(out, t, z).to(dtype), canvas_mask)).argmax(-1))
            pinned = scheduler.output_for(model.latents(ids, canvas_mask).float(), t, z)
            out = torch.where(pins.rows.to(device), pinned, out)
            decoder_passes += 1
        if on_step is not None and scheduler.next_time(t) > 0:
            logits = model.decode(scheduler.x0_hat(out, t, z).to(dtype), canvas_mask)
            on_step(i, _rows(logits.argmax(-1), widths, eos_id, pad_id, max_new))
            decoder_passes += 1
        last_t = t
        z = scheduler.step(out, t, z, generator)
    logits = model.decode(z.to(dtype), canvas_mask)
    logits = logits if pins is None else pins.guard(logits)
    tau = sampling.tau(last_t)
    ids = read_tokens(logits, tau, generator)
    ids = ids if pins is None else pins.write(ids)
    tokens = _rows(ids, widths, eos_id, pad_id, max_new)
    decoder_passes += 1
    if on_step is not None:
        on_step(steps - 1, tokens)
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).cpu()
    ended = [eos_id is not None and len(t) < min(max_new, w) for t, w in zip(tokens, widths.tolist())]
    confidence = [float(row[:len(t) + end].mean()) for row, t, end in zip(log_probs, tokens, ended)]
    return dd2_result(tokens, time.perf_counter() - t0, steps, passes, decoder_passes, confidence, tau, ended)


def _rows(ids: torch.Tensor, widths: torch.Tensor, eos_id: int | None, pad_id: int,
          max_new: int) -> list[list[int]]:
    """Each canvas's text, within its own width: a seq2seq canvas (eos_id set) ends at its first <eos> or
    <pad> (the text's end is one position, the padding after it many, so a one-step canvas often marks the
    end by its padding alone)."""
    rows = []
    for row, width in zip(ids.tolist(), widths.tolist()):
        row = row[:width]
        if eos_id is not None:
            row = row[:next((i for i, t in enumerate(row) if t in (eos_id, pad_id)), len(row))]
        rows.append(row[:max_new])
    return rows


def hybrid_generate(model: DD2Model, ar: Transformer, sources: list[list[int]], prompts: list[list[int]],
                    max_new: int, *, prefix: int = 50, sampling: DD2Sampling = DD2Sampling(),
                    eos_id: int | None = None, pad_id: int = 0,
                    generator: torch.Generator | None = None) -> GenerationResult:
    """One DD2 sample for the first (up to) `prefix` tokens, then greedy AR continues each row from its
    prompt plus that prefix (one prefill pass fills the KV cache) up to `max_new` tokens. Rows whose one-step
    text ended (`GenerationResult.ended`) are done. `prompts` are the AR model's prompts (seq2seq: source + <sep>)."""
    one = dd2_generate(model, sources, min(prefix, max_new), sampling=sampling, eos_id=eos_id, pad_id=pad_id,
                       generator=generator)
    tokens = [list(toks) for toks in one.tokens]
    origins = written_by(tokens, DIFFUSION, None)
    seconds, ar_passes = one.seconds, 0
    todo = [i for i, done in enumerate(one.ended) if not done and len(tokens[i]) < max_new]
    if todo:
        budget = max_new - min(len(tokens[i]) for i in todo)
        rest = generate(ar, [prompts[i] + tokens[i] for i in todo], budget, pad_id=pad_id, eos_id=eos_id)
        seconds, ar_passes = seconds + rest.seconds, rest.passes["target"]
        for i, more in zip(todo, rest.tokens):
            more = more[:max_new - len(tokens[i])]
            tokens[i] += more
            origins[i] += [AR] * len(more)
    return replace(one, tokens=tokens, seconds=seconds, passes={**one.passes, "target": ar_passes}, origins=origins)


def best_of_generate(model: DD2Model, judge: Transformer | None, sources: list[list[int]],
                     prompts: list[list[int]] | None, max_new: int, *, sampling: DD2Sampling = DD2Sampling(),
                     eos_id: int | None = None, pad_id: int = 0, generator: torch.Generator | None = None,
                     fixed: list[dict[int, int]] | None = None) -> GenerationResult:
    """`sampling.best_of` (n) samples per source from independent noise, all in one batched `dd2_generate`
    call, of which each row keeps the likeliest. With `judge` (an AR model), likeliest means the highest
    mean log-probability per token under the judge, which scores every distinct sample after its prompt in
    one teacher-forced pass (the <eos> of a seq2seq text that marked its end counted, so it weighs where the
    text ends too): the noisy parallel decoding of non-autoregressive translation (Gu et al. 2018,
    arXiv 1711.02281) and OpenAI's `best_of`. Without one, the generator's own decoder judges, by its
    `confidence` in what it read out: no extra pass, but a weaker judge. `prompts` are the judge's prompts
    (seq2seq: source + <sep>); `fixed` pins as in `dd2_generate`. With n = 1 there is nothing to choose."""
    n = sampling.best_of
    rows = [i for i in range(len(sources)) for _ in range(n)]
    out = dd2_generate(model, [sources[i] for i in rows], max_new, sampling=replace(sampling, best_of=1),
                       eos_id=eos_id, pad_id=pad_id, generator=generator, fixed=fixed and [fixed[i] for i in rows])
    if n == 1:
        return out
    t0 = time.perf_counter()
    confidence = out.extra["confidence"]
    score, judged = confidence, {}
    if judge is not None:
        samples = [(i, tuple(t + [eos_id] if end else t))  # a text that ended is scored with its <eos>
                   for i, t, end in zip(rows, out.tokens, out.ended)]
        unique = list(dict.fromkeys(samples))  # one-step samples often agree: each distinct one is scored once
        scores = log_likelihoods(judge, [prompts[i] for i, _ in unique], [list(t) for _, t in unique], pad_id)
        mean = dict(zip(unique, (scores / torch.tensor([max(1, len(t)) for _, t in unique])).tolist()))
        score, judged = [mean[sample] for sample in samples], {"judge": 1}
    best = [max(range(i * n, i * n + n), key=lambda j: score[j]) for i in range(len(sources))]
    return replace(out, tokens=[out.tokens[j] for j in best], seconds=out.seconds + time.perf_counter() - t0,
                   passes={**out.passes, **judged}, ended=[out.ended[j] for j in best],
                   extra={**out.extra, "confidence": [confidence[j] for j in best]})
