"""DD2 stage 2: diffusion in the latent space of a trained text autoencoder (the DD2 seed post,
`seeds/dd2.zh.txt`).

    source tokens (S) ++ noised canvas latents z_t (N)  ->  bidirectional transformer  ->  eps or z0 (N)

The denoiser reads the source as a prefix (its own token embeddings). With `source_encoder` set, a frozen AR
model (the distillation teacher) reads the source too, and its final hidden states are added to the prefix,
as a latent diffusion model reads its prompt through a frozen text encoder: for a continuation, what the
teacher expects to come next is then one linear read away (a seq2seq source is read without its <sep>).
For seq2seq, source and canvas positions both count from 0, so RoPE sees how far a canvas slot is from a
source token: monotone alignment comes cheap. A continuation canvas continues its source: its first slot
takes the position after the last source token, so the nearest text in RoPE's terms is the text the canvas
goes on from. The autoencoder (`TextVQVAE`) rides along frozen inside the checkpoint (as does the source
encoder): it makes z0 from the training canvases and decodes a denoised latent into every token in one pass.

Two parameterisations (`prediction`):
- "eps" (stage 2, `diffar train dd2`): loss E||eps - eps_theta(z_t, t, c)||^2 over uniform t; samplers
  (DDPM, DDIM) turn eps into z0 with the one-step formula.
- "x0" (`diffar distill dd2`): the network predicts z0 directly, trained on the AR teacher's outputs. At
  t = 1 the eps->z0 conversion divides by sqrt(alpha_bar(1)) ~ 0.003 and would blow every error up 300-fold;
  an x0 network makes the one-step jump its plain output. It trains on the DD2 seed post's multi-granularity loss:
      mse_weight * ||z0_hat - z0||^2 + ce_weight * CE(decoder(z0_hat), teacher tokens)
      + bleu_weight * minimum-risk expected BLEU + semantic_weight * (1 - cos(mean embeddings))
      + energy_weight * the AR teacher's energy of the one-step output (`teacher_energy`)
  With `refine_prob`, some of the t < 1 examples are built from the network's own one-step draft x1 instead
  of the true latent: z_t = sqrt(alpha_bar_t) x1 + sqrt(1 - alpha_bar_t) z1, exactly what DDIM feeds the
  second step. Trained only on noised true latents, the network trusts z_t at t < 1 and turns a (blurry,
  off-manifold) draft into garbage; trained on its drafts, it learns to refine them (the iterative
  refinement of non-autoregressive translation, Lee et al. 2018, arXiv 1802.06901).
Coupled distillation (`coupled`; DD1, arXiv 2412.17153): the teacher's targets are its *samples*, each made a
deterministic function of that example's own latent noise z (N, d_latent), drawn by `example_noise` from the
run's seed and the example's index. The teacher's token at canvas slot j is the one its sampler
(`teacher_temperature`, `teacher_top_p`) picks for the Gaussian z[j, 0], the slot's first latent channel
(`token_noise`; `decoding/sampling.sample_coupled` inverts the CDF at Phi(z[j, 0])), and the network's one-step
input (and the noise of its t < 1 examples) is that same z: it regresses "noise and prompt -> the teacher's
sample for that noise", a function, instead of the average of the teacher's many continuations.
Classifier-free guidance (Ho & Salimans 2022, arXiv 2207.12598): `cond_drop` of the training examples lose
their source; sampling mixes the conditional and unconditional outputs by `guidance_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sacrebleu
import torch
import torch.nn.functional as F
from torch import nn

from diffar.config import Config
from diffar.diffusion.scheduler import PREDICTIONS
from diffar.diffusion.schedules import KINDS, NoiseSchedule
from diffar.errors import DiffarError
from diffar.models.time_embedding import timestep_embedding
from diffar.models.transformer import BidirectionalStack, Transformer, TransformerConfig
from diffar.models.vqvae import TextVQVAE, VQVAEConfig

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=1, n_head=4, d_model=64, max_source_len=64),  # tests
    "small": dict(n_layer=6, n_head=8, d_model=256, max_source_len=128),
}


@dataclass
class DD2Config(Config, presets=PRESETS, nested={"vqvae": VQVAEConfig, "source_encoder": TransformerConfig}):
    vqvae: VQVAEConfig = field(default_factory=VQVAEConfig)
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 256
    max_source_len: int = 128
    schedule: str = "cosine"
    prediction: str = "eps"
    cond_drop: float = 0.1  # share of training examples without their source (classifier-free guidance)
    latent_scale: float = 1.0  # z0 = latent_scale * autoencoder latent: unit variance for the diffusion
    # distillation (prediction "x0")
    full_noise_prob: float = 0.75  # share of training examples at t = 1, where one-step sampling starts
    refine_prob: float = 0.0  # share of the t < 1 examples noised from the network's own one-step draft
    mse_weight: float = 1.0
    ce_weight: float = 1.0
    bleu_weight: float = 0.0
    semantic_weight: float = 0.0
    energy_weight: float = 0.0  # needs the AR teacher attached (`DD2Model.set_energy_model`; distill dd2 does)
    coupled: bool = False  # targets: the teacher's sample for each example's own noise (else its greedy text)
    teacher_temperature: float = 0.8  # the coupled teacher's sampling
    teacher_top_p: float = 0.95
    bleu_samples: int = 4  # canvases sampled per example for the expected-BLEU loss
    eos_id: int | None = None  # where a seq2seq canvas's text ends (None: continuation, no end)
    source_encoder: TransformerConfig | None = None  # a frozen AR model whose hidden states join the source prefix
    preset: str = ""

    def checks(self):
        return [
            (self.schedule in KINDS, f"unknown noise schedule {self.schedule!r}; choose one of {', '.join(KINDS)}"),
            (self.prediction in PREDICTIONS, f"unknown prediction {self.prediction!r}; choose one of "
                                             f"{', '.join(PREDICTIONS)}"),
            (0 <= self.cond_drop < 1, f"cond_drop must be in [0, 1), got {self.cond_drop}"),
            (0 <= self.full_noise_prob <= 1, f"full_noise_prob must be in [0, 1], got {self.full_noise_prob}"),
            (0 <= self.refine_prob <= 1, f"refine_prob must be in [0, 1], got {self.refine_prob}"),
            (self.latent_scale > 0, f"latent_scale must be positive, got {self.latent_scale}"),
            (self.teacher_temperature >= 0, f"teacher_temperature must be >= 0, got {self.teacher_temperature}"),
            (0 < self.teacher_top_p <= 1, f"teacher_top_p must be in (0, 1], got {self.teacher_top_p}"),
            (self.bleu_samples > 1, f"bleu_samples must be at least 2, got {self.bleu_samples}"),
            (self.source_encoder is None or self.source_encoder.vocab_size == self.vqvae.vocab_size,
             "source_encoder's vocabulary differs from the autoencoder's"),
            *self.nonnegative("mse_weight", "ce_weight", "bleu_weight", "semantic_weight", "energy_weight"),
        ]

    @classmethod
    def from_preset(cls, name: str, vqvae: VQVAEConfig, **overrides) -> DD2Config:
        return super().from_preset(name, vqvae=vqvae, **overrides)

    def canvas_width(self, source_len: int) -> int:
        """Canvas positions for a source: sized by it for seq2seq (the text ends at <eos> within it), the
        autoencoder's `target_len` for continuation."""
        return self.vqvae.width(source_len) if self.eos_id is not None else self.vqvae.target_len

    def stack_config(self) -> TransformerConfig:
        return TransformerConfig(vocab_size=self.vqvae.vocab_size, n_layer=self.n_layer, n_head=self.n_head,
                                 d_model=self.d_model, max_seq_len=self.max_source_len + self.vqvae.max_len)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the same weights and buffers, at bf16 resolution (so that an exported bf16
    copy of an autoencoder still counts as the one a diffusion model was trained in)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and torch.equal(sa[k].to(torch.bfloat16), sb[k].to(torch.bfloat16)) for k in sa)


def example_noise(seed: int, index: int, width: int, d_latent: int) -> torch.Tensor:
    """The latent noise (width, d_latent) of training example `index` of a coupled distillation: standard
    normal, from a generator seeded by (seed, index), so it is drawn again wherever it is needed, never stored."""
    return torch.randn(width, d_latent, generator=torch.Generator().manual_seed(seed * 1_000_003 + index))


def token_noise(z: torch.Tensor) -> torch.Tensor:
    """Canvas noise (..., N, d_latent) -> the noise (..., N) that fixes the teacher's token at each slot: the
    slot's first latent channel (standard normal, as `sample_coupled` takes it)."""
    return z[..., 0]


class LatentDenoiser(nn.Module):
    """(z_t (B, N, d_latent), t (B,), source (B, S), source_mask (B, S)) -> eps or z0 (B, N, d_latent);
    `canvas_mask` (B, N) marks the positions each row's canvas has (default: all); `states` (B, S, d) are the
    source encoder's hidden states over the source (required when the config has a source encoder)."""

    def __init__(self, cfg: DD2Config):
        super().__init__()
        stack = cfg.stack_config()
        self.d_model = cfg.d_model
        self.src_emb = nn.Embedding(cfg.vqvae.vocab_size, cfg.d_model)
        self.segment = nn.Embedding(2, cfg.d_model)  # 0: source token, 1: canvas latent
        self.states_in = nn.Linear(cfg.source_encoder.d_model, cfg.d_model) if cfg.source_encoder else None
        self.latent_in = nn.Linear(cfg.vqvae.d_latent, cfg.d_model)
        self.time_mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.SiLU(),
                                      nn.Linear(cfg.d_model, cfg.d_model))
        self.stack = BidirectionalStack(stack)
        self.latent_out = nn.Linear(cfg.d_model, cfg.vqvae.d_latent)
        self.config = cfg  # read at each pass: `eos_id` (None: continuation) is set once the data is known
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, z: torch.Tensor, t: torch.Tensor, source: torch.Tensor, source_mask: torch.Tensor,
                canvas_mask: torch.Tensor | None = None, states: torch.Tensor | None = None) -> torch.Tensor:
        B, N, _ = z.shape
        S = source.shape[1]
        if S > self.config.max_source_len:
            raise DiffarError(f"source of {S} tokens exceeds the model's {self.config.max_source_len}")
        time = self.time_mlp(timestep_embedding(t, self.d_model).to(z.dtype)).unsqueeze(1)
        src = self.src_emb(source) + self.segment.weight[0]
        if self.states_in is not None:
            src = src + self.states_in(states.to(src.dtype))
        canvas = self.latent_in(z) + self.segment.weight[1] + time
        canvas_start = source_mask.sum(1, keepdim=True) if self.config.eos_id is None else torch.zeros(
            B, 1, dtype=torch.long, device=z.device)
        positions = torch.cat([torch.arange(S, device=z.device).expand(B, S),
                               canvas_start + torch.arange(N, device=z.device)], dim=1)
        canvas_mask = source_mask.new_ones(B, N) if canvas_mask is None else canvas_mask
        key_mask = torch.cat([source_mask, canvas_mask], dim=1)
        h = self.stack(torch.cat([src, canvas], dim=1), key_mask, positions)
        return self.latent_out(h[:, S:])


class DD2Model(nn.Module):
    loss_is_nll = False

    def __init__(self, cfg: DD2Config):
        super().__init__()
        self.config = cfg
        self.vqvae = TextVQVAE(cfg.vqvae).requires_grad_(False).eval()  # frozen: no codebook updates
        self.source_encoder = (Transformer(cfg.source_encoder).requires_grad_(False).eval()
                               if cfg.source_encoder else None)
        self.denoiser = LatentDenoiser(cfg)
        self.schedule = NoiseSchedule(cfg.schedule)
        self.loss_parts: dict[str, float] = {}
        # (teacher, sep_id) for the energy loss: a plain tuple, so the teacher is neither a parameter nor saved
        self.energy_model: tuple[Transformer, int | None] | None = None

    def train(self, mode: bool = True) -> DD2Model:
        super().train(mode)
        self.vqvae.eval()  # frozen: no dropout of codes, no codebook updates
        if self.source_encoder is not None:
            self.source_encoder.eval()
        return self

    def set_vqvae(self, vqvae: TextVQVAE) -> None:
        """Adopt a trained autoencoder (its config must equal this model's)."""
        if vqvae.config.to_dict() != self.config.vqvae.to_dict():
            raise DiffarError("the VQ-VAE's config differs from the one this DD2 model is built for")
        self.vqvae.load_state_dict(vqvae.state_dict())

    def set_source_encoder(self, ar: Transformer) -> None:
        """Adopt a trained AR model as the source encoder (its config must equal this model's)."""
        if self.source_encoder is None or ar.config.to_dict() != self.config.source_encoder.to_dict():
            raise DiffarError("the AR model's config differs from the source encoder this DD2 model is built for")
        self.source_encoder.load_state_dict(ar.state_dict())

    def set_energy_model(self, teacher: Transformer, sep_id: int | None) -> None:
        """The frozen AR model whose energy the one-step output is trained to lower (`energy_weight`); it reads
        a seq2seq source followed by `sep_id`, a continuation prompt as it is."""
        if teacher.config.vocab_size != self.config.vqvae.vocab_size:
            raise DiffarError("the energy model's vocabulary differs from the autoencoder's")
        self.energy_model = (teacher.requires_grad_(False).eval(), sep_id)

    @torch.no_grad()
    def encode_source(self, source: torch.Tensor) -> torch.Tensor | None:
        """The source encoder's final hidden states over right-padded sources (B, S, d) (causal: the padding
        after a row's text does not reach it), or None without a source encoder."""
        return None if self.source_encoder is None else self.source_encoder.hidden_states(source)

    @torch.no_grad()
    def calibrate(self, canvases: torch.Tensor) -> None:
        """Set latent_scale to 1 / the standard deviation of these canvases' latents: unit-variance data for
        the diffusion, as latent diffusion models scale theirs."""
        self.config.latent_scale = float(1 / self.vqvae.encode(canvases).float().std())

    @torch.no_grad()
    def latents(self, canvas: torch.Tensor, canvas_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token canvases (B, N) -> z0 (B, N, d_latent), scaled for the diffusion; `canvas_mask` as in `decode`."""
        return self.vqvae.encode(canvas, canvas_mask) * self.config.latent_scale

    def decode(self, z0: torch.Tensor, canvas_mask: torch.Tensor | None = None) -> torch.Tensor:
        """z0 (B, N, d_latent) -> token logits (B, N, V)."""
        return self.vqvae.decode(z0 / self.config.latent_scale, canvas_mask)

    def predict(self, z: torch.Tensor, t: torch.Tensor, source: torch.Tensor, source_mask: torch.Tensor,
                guidance_scale: float = 1.0, canvas_mask: torch.Tensor | None = None,
                states: torch.Tensor | None = None) -> torch.Tensor:
        """The network's output with classifier-free guidance: u + w (c - u); w = 1 is conditional only.
        `states`: `encode_source(source)`, made here when not given (a many-step sampler makes it once)."""
        if states is None:
            states = self.encode_source(source)
        if guidance_scale == 1.0:
            return self.denoiser(z, t, source, source_mask, canvas_mask, states)
        B = len(z)
        out = self.denoiser(torch.cat([z, z]), torch.cat([t, t]), torch.cat([source, source]),
                            torch.cat([source_mask, torch.zeros_like(source_mask)]),
                            None if canvas_mask is None else torch.cat([canvas_mask, canvas_mask]),
                            None if states is None else torch.cat([states, states]))
        cond, uncond = out[:B], out[B:]
        return uncond + guidance_scale * (cond - uncond)

    def forward(self, source: torch.Tensor, source_mask: torch.Tensor, targets: torch.Tensor,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`noise` (B, N, d_latent): each example's own noise (coupled distillation: the noise its target was
        sampled for), which every example is noised with and a one-step draft starts from; default: fresh."""
        cfg = self.config
        B = len(targets)
        z0 = self.latents(targets)
        t = torch.rand(B, device=z0.device)
        if cfg.prediction == "x0":
            t = torch.where(torch.rand(B, device=z0.device) < cfg.full_noise_prob, torch.ones_like(t), t)
        noise = torch.randn_like(z0) if noise is None else noise.to(z0)
        z_t = self.schedule.q_sample(z0, t, noise)
        keep = (torch.rand(B, 1, device=z0.device) >= cfg.cond_drop) if self.training else True
        states = self.encode_source(source)
        if cfg.prediction == "x0" and cfg.refine_prob:
            z_t = self._from_drafts(z_t, t, noise, source, source_mask & keep, states)
        out = self.denoiser(z_t, t, source, source_mask & keep, states=states)
        if cfg.prediction == "eps":
            loss = F.mse_loss(out, noise)
            self.loss_parts = {"eps_mse": float(loss.detach())}
            return out, loss
        one_step = (t == 1) & (keep.squeeze(1) if self.training else True)  # one-step outputs given their source
        return out, self._distillation_loss(out, z0, targets, source, source_mask, one_step)

    def _from_drafts(self, z_t: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, source: torch.Tensor,
                     source_mask: torch.Tensor, states: torch.Tensor | None) -> torch.Tensor:
        """z_t with a `refine_prob` share of the t < 1 rows replaced by DDIM's second-step input: the noised
        one-step draft from the row's `noise` (no gradient through the draft)."""
        rows = ((t < 1) & (torch.rand(len(t), device=t.device) < self.config.refine_prob)).nonzero().squeeze(1)
        if len(rows) == 0:
            return z_t
        start = noise[rows]
        with torch.no_grad():
            draft = self.denoiser(start, torch.ones_like(t[rows]), source[rows], source_mask[rows],
                                  states=None if states is None else states[rows])
        a = self.schedule.alpha_bar(t[rows]).view(-1, 1, 1).to(z_t.dtype)
        return z_t.index_put((rows,), a.sqrt() * draft + (1 - a).sqrt() * start)

    def _distillation_loss(self, z0_hat: torch.Tensor, z0: torch.Tensor, targets: torch.Tensor,
                           source: torch.Tensor, source_mask: torch.Tensor, one_step: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        logits = self.decode(z0_hat).float()
        parts = {"mse": F.mse_loss(z0_hat, z0), "ce": F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))}
        if cfg.bleu_weight:
            parts["bleu"] = expected_bleu_risk(logits, targets, cfg.bleu_samples, cfg.eos_id)
        if cfg.semantic_weight:
            parts["semantic"] = semantic_distance(logits, targets, self.vqvae.tok_emb.weight)
        if cfg.energy_weight and one_step.any():
            parts["energy"] = self._energy(logits[one_step], source[one_step], source_mask[one_step],
                                           targets[one_step])
        weights = {"mse": cfg.mse_weight, "ce": cfg.ce_weight, "bleu": cfg.bleu_weight,
                   "semantic": cfg.semantic_weight, "energy": cfg.energy_weight}
        loss = sum(weights[k] * v for k, v in parts.items())
        self.loss_parts = {k: float(v.detach()) for k, v in parts.items()}
        self.loss_parts["token_acc"] = float((logits.argmax(-1) == targets).float().mean())
        return loss

    def _energy(self, logits: torch.Tensor, source: torch.Tensor, source_mask: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        """`teacher_energy` of these rows' decoded canvases, over the slots before each target's <eos>. The
        <eos> slot itself is not scored (a canvas may end in <pad>, which the teacher never predicts): the end
        of the text is left to the position-wise terms, or, with the energy alone, to what the model had
        learnt before."""
        if self.energy_model is None:
            raise DiffarError("energy_weight needs the AR teacher attached (set_energy_model; distill dd2 does it)")
        teacher, sep_id = self.energy_model
        teacher.to(logits.device)  # the trainer moves this model to its device, not the unregistered teacher
        prompt, prompt_len = source, source_mask.sum(1)
        if sep_id is not None:  # seq2seq: the teacher reads source <sep>
            prompt = F.pad(source, (0, 1)).scatter(1, prompt_len[:, None], sep_id)
            prompt_len = prompt_len + 1
        content = torch.ones_like(targets, dtype=torch.bool) if self.config.eos_id is None \
            else (targets == self.config.eos_id).cumsum(1) == 0
        return teacher_energy(teacher, logits, prompt, prompt_len, content)


def _text(ids: list[int], eos_id: int | None) -> str:
    """A canvas's token ids up to its first <eos>, as the space-separated string sacrebleu scores."""
    if eos_id is not None and eos_id in ids:
        ids = ids[:ids.index(eos_id)]
    return " ".join(map(str, ids))


def expected_bleu_risk(logits: torch.Tensor, targets: torch.Tensor, samples: int, eos_id: int | None,
                       alpha: float = 0.005) -> torch.Tensor:
    """Minimum-risk training (Shen et al. 2016, arXiv 1512.02433) with BLEU as the gain: draw `samples`
    canvases per row from the decoder's per-position distributions (they are independent: one parallel
    pass), score each with sentence BLEU against the target (sacrebleu on token ids, up to <eos>), and return the
    expected risk 1 - BLEU/100 under Q(y) ∝ p(y)^alpha over the drawn set."""
    logp = F.log_softmax(logits, dim=-1)  # (B, N, V)
    draws = torch.distributions.Categorical(logits=logits.detach()).sample((samples,))  # (K, B, N)
    seq_logp = logp.unsqueeze(0).expand(samples, -1, -1, -1).gather(-1, draws.unsqueeze(-1)).squeeze(-1).sum(-1)
    refs = [_text(row, eos_id) for row in targets.tolist()]
    gains = torch.tensor([[sacrebleu.sentence_bleu(_text(hyp, eos_id), [ref], tokenize="none").score / 100
                           for hyp, ref in zip(k_rows, refs)] for k_rows in draws.tolist()], device=logits.device)
    q = torch.softmax(alpha * seq_logp, dim=0)  # (K, B) over each row's draws
    return ((1 - gains) * q).sum(0).mean()


def semantic_distance(logits: torch.Tensor, targets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity of the mean token embedding of the prediction (expected under the decoder's
    distributions) and of the target, in the autoencoder's embedding space: a sequence-level meaning term
    that does not care where in the canvas a word lands."""
    predicted = (F.softmax(logits, dim=-1) @ table.float()).mean(1)
    reference = F.embedding(targets, table.float()).mean(1)
    return (1 - F.cosine_similarity(predicted, reference, dim=-1)).mean()


def teacher_energy(teacher: Transformer, logits: torch.Tensor, prompt: torch.Tensor, prompt_len: torch.Tensor,
                   content: torch.Tensor) -> torch.Tensor:
    """ENGINE's energy (Tu et al. 2020, arXiv 2005.00850): the AR teacher's cross-entropy of a relaxed
    non-autoregressive output. Slot i's token distribution q_i = softmax(logits_i) enters the teacher as its
    expected embedding, after each row's prompt (right-padded `prompt`, `prompt_len` tokens), and

        energy = mean over `content` slots of  -sum_v q_i(v) log p_teacher(v | prompt, q_<i)

    A one-hot q gives the teacher's negative log-likelihood of that text. Unlike cross-entropy against the
    teacher's text slot by slot, a word one slot early or late is not wrong at every later slot: the teacher
    scores the generator's own prefix, so the loss rewards text the teacher finds likely, wherever its words
    land, rather than the teacher's exact positions."""
    q = F.softmax(logits.float(), dim=-1)  # (B, N, V)
    table = teacher.tok_emb.weight
    N, d = q.shape[1], table.shape[1]
    # the teacher reads each row's prompt, then slots 0..N-2 (the last slot's input predicts nothing)
    slot = torch.arange(prompt.shape[1] + N - 1, device=q.device) - prompt_len[:, None]  # (B, T); < 0: prompt
    soft = (q.to(table.dtype) @ table).gather(1, slot.clamp(0, N - 1).unsqueeze(-1).expand(-1, -1, d))
    x = torch.where((slot < 0).unsqueeze(-1), F.embedding(F.pad(prompt, (0, N - 1)), table), soft)
    reads = prompt_len[:, None] - 1 + torch.arange(N, device=q.device)  # the position that predicts each slot
    h = teacher.hidden_states(embeddings=x).gather(1, reads.unsqueeze(-1).expand(-1, -1, d))
    logp = F.log_softmax(teacher.lm_head(h).float(), dim=-1)
    energy = -(q * logp).sum(-1)
    return (energy * content).sum() / content.sum().clamp(min=1)
