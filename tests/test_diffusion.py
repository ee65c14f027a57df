"""Noise schedules and the DDIM sampler (weights-free diffusion math)."""

import pytest
import torch

from diffar.diffusion.schedules import KINDS, NoiseSchedule
from diffar.diffusion.scheduler import DDIMScheduler
from diffar.errors import DiffarError


@pytest.mark.parametrize("kind", KINDS)
def test_alpha_bar_falls_from_clean_to_noise(kind):
    schedule = NoiseSchedule(kind)
    if kind == "learned":  # any shape the training may give it stays monotone
        with torch.no_grad():
            schedule.increments.copy_(torch.randn(len(schedule.increments), generator=torch.Generator().manual_seed(0)))
    a = schedule.alpha_bar(torch.linspace(0, 1, 101))
    assert bool((a[1:] < a[:-1]).all())
    assert a[0] > 0.99 and a[-1] < 1e-3 and bool(((a > 0) & (a < 1)).all())


def test_unknown_schedule():
    with pytest.raises(DiffarError, match="unknown noise schedule"):
        NoiseSchedule("square")


@pytest.mark.parametrize("t", [0.1, 0.5, 0.9])
def test_q_sample_mean_and_variance(t):
    schedule = NoiseSchedule("cosine")
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 8, generator=g).expand(20000, 8)
    z = schedule.q_sample(x0, torch.full((20000,), t), torch.randn(20000, 8, generator=g))
    a = float(schedule.alpha_bar(torch.tensor(t)))
    torch.testing.assert_close(z.mean(0), a ** 0.5 * x0[0], atol=0.03, rtol=0)
    torch.testing.assert_close(z.var(0), torch.full((8,), 1 - a), atol=0.03, rtol=0)


def test_learned_schedule_is_trainable():
    schedule = NoiseSchedule("learned")
    schedule.alpha_bar(torch.rand(16)).sum().backward()
    assert schedule.increments.grad is not None and bool(schedule.increments.grad.abs().sum() > 0)


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_ddim_with_a_perfect_prediction_follows_the_forward_process(steps):
    """Given the true x0, each DDIM step lands exactly on q(z_t' | x0) with the same noise, and the last
    step (the one-step jump when steps = 1) returns x0 itself."""
    schedule = NoiseSchedule("cosine")
    scheduler = DDIMScheduler(schedule)
    scheduler.set_timesteps(steps)
    assert len(scheduler.timesteps) == steps and float(scheduler.timesteps[0]) == 1.0
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    z = schedule.q_sample(x0, torch.ones(4), eps)
    for t in scheduler.timesteps.tolist():
        z = scheduler.step(x0, t, z)
        t_next = scheduler.next_time(t)
        expected = x0 if t_next == 0 else schedule.q_sample(x0, torch.full((4,), t_next), eps)
        torch.testing.assert_close(z, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z, x0)


def test_ddim_needs_a_positive_number_of_steps():
    with pytest.raises(DiffarError, match="must be positive"):
        DDIMScheduler(NoiseSchedule()).set_timesteps(0)
