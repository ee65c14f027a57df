"""Methods whose text is an AR model's: plain KV-cached decoding, draft-and-verify with a proposer (prompt
lookup, a draft model), and ReFusion, whose diffusion stream drafts for its own AR stream. All are lossless:
greedy output equals plain greedy AR, sampled output follows the AR model's distribution (ReFusion's
plan-and-infill aside)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from diffar.data.batching import prompt_ids
from diffar.decoding.ar import generate
from diffar.decoding.datastore import Datastore
from diffar.decoding.refusion import DraftSchedule, refusion_generate
from diffar.decoding.result import GenerationResult
from diffar.decoding.sampling import SamplingConfig
from diffar.decoding.speculative import PromptLookup, Proposer, WithPromptLookup, speculative_generate
from diffar.decoding.drafter import BlockProposer
from diffar.generation.method import OptionError, Options, per_row, within_budgets
from diffar.models.drafter import BlockDrafter
from diffar.models.refusion import RefusionModel
from diffar.models.transformer import Transformer
from diffar.tokenizer import Tokenizer


class ARMethod:
    name = "ar"
    options = frozenset({"temperature", "top_k", "top_p"})
    domains: tuple[str, ...] = ()

    def __init__(self, model: Transformer, tokenizer: Tokenizer, task: str, *, proposer: Proposer | None = None,
                 k: int = 8, use_cache: bool = True, adaptive: bool = False, compiled: bool = False):
        """`compiled`: the model's decoding passes (and its proposer's) are compiled (models/precision.compile_decode),
        whose graphs are made per batch size: batches are padded to a power of two so that a few graphs serve
        every size."""
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.proposer, self.k, self.use_cache, self.adaptive = proposer, k, use_cache, adaptive
        self.compiled = compiled
        self.drafter = proposer and proposer.name  # what drafts, for the speed line
        self.label = ("ar-compile" if compiled else "ar") if proposer is None else f"ar+{proposer.name}"

    def prompt(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, self.task, text)

    def room(self, ids: list[int], settings=None) -> int:
        return self.model.config.max_seq_len - len(ids)

    def fits(self, longest_prompt: int, budget: int) -> bool:
        return longest_prompt + budget <= self.model.config.max_seq_len  # one cache for the batch

    def settings(self, options: Options) -> SamplingConfig:
        return SamplingConfig(**{name: getattr(options, name) for name in self.options
                                 if getattr(options, name) is not None})

    def generate(self, prompts: list[list[int]], budgets: int | list[int], settings: SamplingConfig, *,
                 on_token=None, on_step=None, generator=None, fixed=None, ignore_eos: bool = False) -> GenerationResult:
        budgets, rows = per_row(budgets, len(prompts)), len(prompts)
        if self.compiled and rows & (rows - 1):  # pad with one-token rows up to a power of two
            filler = (1 << rows.bit_length()) - rows
            prompts, budgets = prompts + [prompts[0]] * filler, budgets + [1] * filler
            fixed = fixed and fixed + [{}] * filler
            given = on_token
            on_token = given and (lambda row, token, origin: row < rows and given(row, token, origin))
        decode = dict(eos_id=None if ignore_eos else self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                      sampling=settings, generator=generator, on_token=within_budgets(budgets, on_token), fixed=fixed)
        if self.proposer is None:
            result = generate(self.model, prompts, max(budgets), use_cache=self.use_cache, **decode)
        else:
            result = speculative_generate(self.model, self.proposer, prompts, max(budgets), k=self.k,
                                          adaptive=self.adaptive, **decode)
        return replace(result, tokens=result.tokens[:rows], ended=result.ended[:rows], origins=result.origins[:rows])

    def describe(self, result: GenerationResult, settings) -> tuple[str, str]:
        """(label, account of the passes) of a one-row result, for the speed line."""
        n, passes = result.new_tokens, result.passes["target"]
        chosen = n + sum(result.ended)  # the end token too: choosing it took a pass
        line = f"{passes} AR passes ({chosen / passes:.2f} tokens/AR pass)"
        if "drafted" not in result.extra:
            return self.label, line + f" | {'KV cache' if self.use_cache else 'no cache'}"
        compiled = ", compiled" if self.compiled else ""
        return self.label, line + (f" | {result.extra['accepted']}/{result.extra['drafted']} drafts accepted, "
                                   f"{result.passes['draft']} {self.drafter} passes{compiled}")


@dataclass(frozen=True)
class DraftSampling(SamplingConfig):
    """ReFusion's settings: the AR stream's sampling, and the domain its diffusion stream drafts for (an index into
    the model's domains; None for a stream without a domain adapter)."""

    domain: int | None = None


class RefusionMethod(ARMethod):
    """ReFusion: the diffusion stream drafts blocks from the AR stream's hidden states, the AR stream verifies
    them; `schedule` is how hard it drafts (one DDIM step per block by default; the DD2 seed post's dynamic
    schedule; plan-and-infill; a tree; prompt lookup's copies joining the drafts, from a datastore too). A block
    drafter (models/drafter.py) drafts a block per pass for the target it is attached to, as a chain or a tree
    (`schedule.tree`)."""

    name = "refusion"
    options = ARMethod.options | {"domain"}

    def __init__(self, model: RefusionModel | BlockDrafter, tokenizer: Tokenizer, task: str, *,
                 schedule: DraftSchedule = DraftSchedule(), k: int | None = None, compiled: bool = False,
                 datastore: Datastore | None = None):
        """`datastore`: what prompt lookup (`schedule.lookup`) also drafts from (decoding/datastore.py)."""
        block = isinstance(model, BlockDrafter)
        if datastore and not schedule.lookup:
            raise OptionError("datastore", "a datastore serves prompt lookup: add it (--prompt-lookup)")
        if compiled and not block:
            raise OptionError("compile", "compile applies to a block drafter and its target, not to an embedding "
                                         "diffusion stream (a ReFusion checkpoint)")
        if block and (schedule.dynamic or schedule.plan_threshold is not None or schedule.steps != 1):
            raise OptionError("schedule", "a block drafter drafts in one pass: denoising steps, the dynamic "
                                          "schedule and plan-and-infill apply to the embedding drafter only")
        k_block = min(k or model.config.block - 1, model.config.block - 1) if block else 8
        proposer = BlockProposer(model, schedule.tree) if block else None
        if proposer and schedule.lookup:
            proposer = WithPromptLookup(proposer, lookup=PromptLookup(datastore=datastore))
        super().__init__(model.target if block else model.ar, tokenizer, task, proposer=proposer, k=k_block,
                         adaptive=True, compiled=compiled)  # verify about 1.5x what recent blocks kept, as ReFusion's
        self.refusion, self.schedule, self.datastore = model, schedule, datastore
        self.drafter = "drafter" if block else "diffusion"
        self.domains = () if block else model.config.domains
        if not block:
            self.k = k
        self.label = "refusion" + "".join(suffix for suffix, on in (
            ("-dynamic", schedule.dynamic), ("-infill", schedule.plan_threshold), ("-tree", schedule.tree),
            ("+prompt-lookup", schedule.lookup), ("+datastore", datastore)) if on)

    def settings(self, options: Options) -> DraftSampling:
        domains = self.domains
        if options.domain is not None and options.domain not in domains:
            raise OptionError("domain", f"unknown domain {options.domain!r}: this drafter serves "
                                        f"{', '.join(domains) if domains else 'no domains (it has no domain adapter)'}")
        if domains and options.domain is None:
            raise OptionError("domain", f"this diffusion stream drafts for the domains {', '.join(domains)}: "
                                        f"choose one")
        sampling = super().settings(replace(options, domain=None))
        return DraftSampling(**asdict(sampling), domain=domains.index(options.domain) if domains else None)

    def generate(self, prompts: list[list[int]], budgets: int | list[int], settings: DraftSampling, *,
                 on_token=None, on_step=None, generator=None, fixed=None, ignore_eos: bool = False) -> GenerationResult:
        if self.proposer is not None:  # a block drafter: draft-and-verify as any proposer
            return super().generate(prompts, budgets, settings, on_token=on_token, generator=generator, fixed=fixed,
                                    ignore_eos=ignore_eos)
        budgets = per_row(budgets, len(prompts))
        # the dynamic schedule decodes short prompts by AR alone, counted in words of the text they read
        words = [len(self.tokenizer.decode(p).split()) for p in prompts] if self.schedule.dynamic else None
        return refusion_generate(self.refusion, prompts, max(budgets), k=self.k, schedule=self.schedule,
                                 prompt_words=words, eos_id=None if ignore_eos else self.tokenizer.eos_id,
                                 pad_id=self.tokenizer.pad_id, sampling=settings, generator=generator,
                                 on_token=within_budgets(budgets, on_token), fixed=fixed, domain=settings.domain,
                                 datastore=self.datastore)
