"""The model's launch-lean closed forms against plain autograd.

``multiply_add`` replaces ``addcmul`` (whose derivative multiplies by its unit ``value`` first),
``log_envelope_bias`` the guarded ``2·log env`` of the attention logit bias and ``seed_vectors``
the env seed's ``r̃``; all must give the same values and first and second derivatives as the
plain expressions, including the broadcast shapes they are used with and envelopes that are
exactly 0.
"""

from __future__ import annotations

import math

import torch

from service.model.layers.embedding import seed_vectors
from service.model.layers.pointwise import log_envelope_bias, multiply_add
from tests.graph.test_edge_cache_ops import _OpCounter


def _random(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_(True)


def test_multiply_add_matches_addcmul_to_second_order() -> None:
    """The FFN's broadcast pattern: (N, D, H) base and left, (N, 1, H) right."""
    base, left, right = _random(3, 4, 5, seed=0), _random(3, 4, 5, seed=1), _random(3, 1, 5, seed=2)
    weights = _random(3, 4, 5, seed=3).detach()
    inputs = (base, left, right)

    def derivatives(fn):  # type: ignore[no-untyped-def]
        out = fn(*inputs)
        first = torch.autograd.grad((out * weights).sum(), inputs, create_graph=True)
        objective = sum(g.square().sum() for g in first)
        second = torch.autograd.grad(objective, inputs, allow_unused=True, materialize_grads=True)
        return out, first, second

    got = derivatives(multiply_add)
    want = derivatives(torch.addcmul)
    torch.testing.assert_close(got[0], want[0], rtol=0.0, atol=0.0)
    for g, w in zip((*got[1], *got[2]), (*want[1], *want[2]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-14)


def test_multiply_add_backward_skips_unit_products() -> None:
    """Backward: one product per differentiable factor (addcmul takes two) plus the broadcast
    reduction."""
    base, left, right = _random(6, 9, seed=4), _random(6, 9, seed=5), _random(6, 1, seed=6)
    out = multiply_add(base, left, right)
    seed = torch.ones_like(out)
    with _OpCounter() as backward:
        torch.autograd.grad(out, (base, left, right), seed)
    assert backward.count <= 3, backward.count


def test_log_envelope_bias_values_and_derivatives() -> None:
    """``logits + 2 log env``: −inf and zero gradient where env = 0; elsewhere first and second
    derivatives equal autograd through the plain log."""
    env = torch.tensor([0.0, 1e-30, 0.2, 0.7, 1.0], dtype=torch.float64, requires_grad=True)
    logits = _random(5, 3, seed=7)
    weights = _random(5, 3, seed=8).detach()
    out = log_envelope_bias(logits, env)
    assert bool(torch.isneginf(out[0]).all())
    torch.testing.assert_close(out[1:], logits[1:] + 2.0 * torch.log(env[1:])[:, None])

    # Only finite entries enter the objective (what a softmax does with a −inf logit).
    finite = torch.isfinite(out)
    objective = torch.where(finite, out * weights, 0.0).sum()
    grad_logits, grad_env = torch.autograd.grad(objective, (logits, env), create_graph=True)
    assert float(grad_env[0].detach()) == 0.0
    torch.testing.assert_close(grad_logits, torch.where(finite, weights, 0.0))
    expected = 2.0 * weights[1:].sum(dim=1) / env[1:].detach()
    torch.testing.assert_close(grad_env[1:].detach(), expected, rtol=1e-14, atol=0.0)
    (second,) = torch.autograd.grad(grad_env[2:].square().sum(), env)
    point = env.detach()[2:].clone().requires_grad_(True)
    plain = (2.0 * weights[2:].sum(dim=1) / point).square().sum()
    (second_want,) = torch.autograd.grad(plain, point)
    torch.testing.assert_close(second[2:], second_want, rtol=1e-13, atol=0.0)
    assert float(second[0]) == 0.0 and not math.isnan(float(second[1]))


def test_log_envelope_bias_launches() -> None:
    """Two launches forward (log, add), at most six backward (mask, sum, quotient)."""
    env = torch.rand(50, dtype=torch.float64).requires_grad_(True)
    logits = _random(50, 2, seed=9)
    with _OpCounter() as forward:
        out = log_envelope_bias(logits, env)
    seed = torch.ones_like(out)
    with _OpCounter() as backward:
        torch.autograd.grad(out, (logits, env), seed)
    assert forward.count <= 2, forward.count
    assert backward.count <= 6, backward.count


def test_seed_vectors_closed_form_to_second_order() -> None:
    """The env seed's ``r̃ = [env/len, env·r/len²]`` (embedding.seed_vectors): values and first
    and second derivatives with respect to all three inputs equal plain autograd."""
    vec, env, inv_length = _random(7, 3, seed=10), _random(7, seed=11), _random(7, seed=12)
    inputs = (vec, env, inv_length)
    weights = _random(7, 4, seed=13).detach()

    def plain(v: torch.Tensor, e: torch.Tensor, il: torch.Tensor) -> torch.Tensor:
        s = e * il
        return torch.cat([s[:, None], v * (s * il)[:, None]], dim=1)

    def derivatives(fn):  # type: ignore[no-untyped-def]
        out = fn(*inputs)
        first = torch.autograd.grad((out * weights).sum(), inputs, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), inputs)
        return (out, *first, *second)

    for g, w in zip(derivatives(seed_vectors), derivatives(plain), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-14)
