"""The one result every decoder returns (plain AR, draft-and-verify, ReFusion, DD2), so that the CLI, the
benchmarks and the server read every method the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

# Forward passes by kind: "target" (the AR model whose text it is: prefill, steps, verifications), "draft"
# (a drafter's), "denoiser" (DD2's latent denoiser; a guided step is one pass over a doubled batch),
# "decoder" (DD2's token decoder), "judge" (the AR model that scores best-of-n samples).
MODEL_PASSES = ("target", "denoiser", "judge")  # the passes that write or check the text, in `forward_passes`

# Who wrote each new token (`GenerationResult.origins`, the token callback's third argument, the server's `origins`):
# the AR model's own choice (every token of plain AR; at each verification its correction or bonus token), a draft
# it accepted (a drafter's, ReFusion's diffusion stream's, prompt lookup's copy), a token a person pinned, a token
# DD2's decoder read out of its canvas.
AR, DRAFT, PINNED, DIFFUSION = "ar", "draft", "pinned", "diffusion"


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, the end token excluded
    seconds: float
    passes: dict[str, int]  # forward passes of the batch, by kind (above)
    ended: list[bool] = field(default_factory=list)  # per row: the text marked its end (<eos>), not its budget
    extra: dict = field(default_factory=dict)  # method-specific: drafts proposed and accepted, DD2's steps...
    origins: list[list[str]] = field(default_factory=list)  # per row, who wrote each token (above); [] untold

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def forward_passes(self) -> int:
        """The sequential passes of the models that write or check the text (a drafter's passes and DD2's
        decoder passes are counted apart, in `passes`)."""
        return sum(self.passes.get(kind, 0) for kind in MODEL_PASSES)


def written_by(tokens: list[list[int]], author: str, fixed: list[dict[int, int]] | None) -> list[list[str]]:
    """The origins of rows that `author` wrote whole but for their pinned positions (`fixed`, per row)."""
    fixed = fixed or [{}] * len(tokens)
    return [[PINNED if i in pins else author for i in range(len(row))] for row, pins in zip(tokens, fixed)]
