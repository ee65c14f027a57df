"""Noise schedules and the DDIM sampler (weights-free diffusion math)."""

import pytest
import torch

from diffar.diffusion.schedules import KINDS, NoiseSchedule
from diffar.diffusion.scheduler import DDIMScheduler, DDPMScheduler
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
    scheduler = DDIMScheduler(schedule, prediction="x0")
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


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_jump_recovers_z0_when_eps_is_the_true_noise(kind):
    """x0_hat = (z_t - sqrt(1 - a) eps) / sqrt(a) inverts q_sample exactly, at any t, one step from t = 1."""
    schedule = NoiseSchedule(kind)
    g = torch.Generator().manual_seed(1)
    z0, eps = torch.randn(3, 5, 8, generator=g, dtype=torch.float64), torch.randn(3, 5, 8, generator=g,
                                                                                  dtype=torch.float64)
    scheduler = DDIMScheduler(schedule, prediction="eps")
    scheduler.set_timesteps(1)
    for t in (1.0, 0.7, 0.2):
        z_t = schedule.q_sample(z0, torch.full((3,), t), eps)
        torch.testing.assert_close(scheduler.x0_hat(eps, t, z_t), z0, rtol=1e-6, atol=1e-6)
    z1 = schedule.q_sample(z0, torch.ones(3), eps)
    torch.testing.assert_close(scheduler.step(eps, 1.0, z1), z0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prediction", ["eps", "x0"])
def test_eps_and_x0_predictions_imply_each_other(prediction):
    schedule = NoiseSchedule("cosine")
    g = torch.Generator().manual_seed(2)
    z0, eps = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    z_t = schedule.q_sample(z0, torch.full((4,), 0.4), eps)
    scheduler = DDIMScheduler(schedule, prediction=prediction)
    out = eps if prediction == "eps" else z0
    torch.testing.assert_close(scheduler.x0_hat(out, 0.4, z_t), z0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scheduler.eps_hat(out, 0.4, z_t), eps, rtol=1e-4, atol=1e-4)


def _toy_eps_model(z: torch.Tensor, t: float) -> torch.Tensor:
    """A fixed smooth stand-in for a trained network (the samplers only need some function of (z, t))."""
    return torch.tanh(z * (1 + t)) * 0.5 + 0.1 * t


def test_ddim_is_deterministic_and_matches_the_reference_loop_with_steps_equal_T():
    """With T steps DDIM visits t_i = i / T and follows the textbook update (Song et al. 2021, eq. 12, eta 0):
    z_{i-1} = sqrt(a_{i-1}) x0_hat + sqrt(1 - a_{i-1}) eps_hat, x0_hat = (z_i - sqrt(1 - a_i) eps_hat) / sqrt(a_i)."""
    T = 50
    schedule = NoiseSchedule("linear")
    z_start = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def sample():
        scheduler = DDIMScheduler(schedule, prediction="eps")
        scheduler.set_timesteps(T)
        z = z_start.clone()
        for t in scheduler.timesteps.tolist():
            z = scheduler.step(_toy_eps_model(z, t), t, z)
        return z

    a = schedule.alpha_bar(torch.arange(T + 1, dtype=torch.float64) / T).double()
    z = z_start.clone()
    for i in range(T, 0, -1):
        eps = _toy_eps_model(z, i / T)
        x0 = (z - (1 - a[i]).sqrt() * eps) / a[i].sqrt()
        z = x0 if i == 1 else a[i - 1].sqrt() * x0 + (1 - a[i - 1]).sqrt() * eps
    first, second = sample(), sample()
    assert torch.equal(first, second)
    torch.testing.assert_close(first, z, rtol=1e-5, atol=1e-5)


def test_ddpm_posterior_step_has_the_right_mean_and_variance():
    """One DDPM step from z_t, given the true x0, samples q(z_s | z_t, x0): check its moments empirically."""
    schedule = NoiseSchedule("cosine")
    scheduler = DDPMScheduler(schedule, prediction="x0")
    scheduler.set_timesteps(4)  # t = 1, .75, .5, .25
    x0 = torch.full((20000, 3), 0.8)
    z_t = torch.full((20000, 3), -0.3)
    z_s = scheduler.step(x0, 0.5, z_t, generator=torch.Generator().manual_seed(0))
    a_t, a_s = (float(schedule.alpha_bar(torch.tensor(v))) for v in (0.5, 0.25))
    a_ts = a_t / a_s
    mean = (a_s ** 0.5 * (1 - a_ts) * 0.8 + a_ts ** 0.5 * (1 - a_s) * -0.3) / (1 - a_t)
    var = (1 - a_s) / (1 - a_t) * (1 - a_ts)
    torch.testing.assert_close(z_s.mean(0), torch.full((3,), mean), atol=0.01, rtol=0)
    torch.testing.assert_close(z_s.var(0), torch.full((3,), var), atol=0.01, rtol=0)
    assert torch.equal(scheduler.step(x0, 0.25, z_t), x0)  # the last step lands on x0_hat


def test_unknown_prediction_type():
    with pytest.raises(DiffarError, match="unknown prediction"):
        DDIMScheduler(NoiseSchedule(), prediction="v")
