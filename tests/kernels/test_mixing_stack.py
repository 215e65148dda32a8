"""so2kernels.so2_mixing_stack: fused op vs eager reference (values, gradients, second order)."""

from __future__ import annotations

import json
import math
from importlib import import_module
from pathlib import Path

import pytest
import torch
from test_gated_act import assert_normwise_close

from so2kernels import mixing_stack_kernels
from so2kernels._dispatch import UnsupportedInputError
from so2kernels.mixing_stack import mixing_stack_reference, so2_mixing_stack
from so2kernels.mixing_stack_backward import mixing_stack_backward
from so2kernels.mixing_stack_fast import measure_stack_error
from so2kernels.mixing_stack_kernels import StackPrecision, split_fp16x3, weight_operands
from tests.offline_compile import compiled_count

mixing_stack_module = import_module("so2kernels.mixing_stack")
mixing_stack_backward_module = import_module("so2kernels.mixing_stack_backward")

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# (lmax, focus_dim, n_focus, n_edge, n_layers, apply_alpha)
CASES = [
    (1, 32, 1, 1, 2, True),
    (2, 32, 2, 7, 3, True),
    (2, 96, 1, 5, 2, False),
    (3, 64, 3, 7, 4, True),
    (2, 128, 1, 9, 3, True),
    (1, 64, 2, 33, 3, False),
    (4, 32, 1, 3, 2, True),
    (5, 32, 2, 3, 2, False),
    (6, 32, 1, 3, 2, True),
    (2, 32, 1, 5, 1, True),
]


def make_operands(
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_edge: int,
    n_layers: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Operands:
    """Random operands at model-like scales (unit activations, 1/sqrt(fan-in) weights)."""
    gen = torch.Generator().manual_seed(seed)
    m0, m1, gate = (lmax + 1) * focus_dim, 2 * lmax * focus_dim, lmax * focus_dim
    u0 = torch.randn(n_focus, n_edge, m0 + m1, generator=gen)
    logits = torch.randn(n_edge, n_focus, generator=gen)
    alpha = 0.98 * torch.softmax(logits, dim=1) + 0.02 / n_focus
    w0 = torch.randn(n_layers, n_focus, m0, m0, generator=gen) / math.sqrt(m0)
    w1 = torch.randn(n_layers, n_focus, m1, m1, generator=gen) / math.sqrt(m1)
    gw = torch.randn(n_layers - 1, n_focus, focus_dim, gate, generator=gen) / math.sqrt(focus_dim)
    return tuple(t.to(device) for t in (u0, alpha, w0, w1, gw))  # type: ignore[return-value]


def _double(ops: Operands, grad_mask: tuple[bool, ...]) -> Operands:
    u0, alpha, w0, w1, gw = (
        t.detach().double().requires_grad_(m) for t, m in zip(ops, grad_mask, strict=True)
    )
    return u0, alpha, w0, w1, gw


def _float(ops: Operands, grad_mask: tuple[bool, ...]) -> Operands:
    u0, alpha, w0, w1, gw = (
        t.detach().clone().requires_grad_(m) for t, m in zip(ops, grad_mask, strict=True)
    )
    return u0, alpha, w0, w1, gw


ALL_GRADS = (True, True, True, True, True)
FORCE_GRADS = (True, True, False, False, False)


@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_edge", "n_layers", "apply_alpha"), CASES
)
def test_forward_and_gradients(
    poisoned_alloc: None,
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_edge: int,
    n_layers: int,
    apply_alpha: bool,
) -> None:
    ops = make_operands(lmax, focus_dim, n_focus, n_edge, n_layers)
    mask = ALL_GRADS if n_layers > 1 else (True, True, True, True, False)
    got_in, ref_in = _float(ops, mask), _double(ops, mask)
    got = so2_mixing_stack(*got_in, lmax, focus_dim, apply_alpha)
    ref = mixing_stack_reference(*ref_in, lmax, focus_dim, apply_alpha)
    for g, r in zip(got, ref, strict=True):
        assert_normwise_close(g, r, 1e-6)

    grad_out = torch.randn_like(got[0])
    wrt = [
        t for t, m in zip(got_in, mask, strict=True) if m and (apply_alpha or t is not got_in[1])
    ]
    wrt_ref = [
        t for t, m in zip(ref_in, mask, strict=True) if m and (apply_alpha or t is not ref_in[1])
    ]
    got_grads = torch.autograd.grad(got[0], wrt, grad_out)
    ref_grads = torch.autograd.grad(ref[0], wrt_ref, grad_out.double())
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert_normwise_close(g, r, 2e-6)


@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_layers"), [(2, 32, 2, 3), (1, 96, 1, 2)]
)
def test_force_path_gradients(
    poisoned_alloc: None,
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_layers: int,
) -> None:
    """Inference backward (no weight gradients), including cotangents on z_all and u_final."""
    ops = make_operands(lmax, focus_dim, n_focus, 7, n_layers, seed=3)
    got_in, ref_in = _float(ops, FORCE_GRADS), _double(ops, FORCE_GRADS)
    got = so2_mixing_stack(*got_in, lmax, focus_dim, True)
    ref = mixing_stack_reference(*ref_in, lmax, focus_dim, True)
    cotangents = [torch.randn_like(t) for t in got]

    def loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return sum((o * c.to(o.dtype)).sum() for o, c in zip(outs, cotangents, strict=True))  # type: ignore[return-value]

    got_grads = torch.autograd.grad(loss(got), got_in[:2])
    ref_grads = torch.autograd.grad(loss(ref), ref_in[:2])
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert_normwise_close(g, r, 2e-6)


@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_layers", "apply_alpha"),
    [(2, 32, 2, 3, True), (1, 96, 1, 2, False), (3, 64, 1, 1, True), (4, 128, 1, 2, True),
     (6, 32, 1, 2, False)],
)  # fmt: skip
def test_second_order_force_loss(
    poisoned_alloc: None, lmax: int, focus_dim: int, n_focus: int, n_layers: int, apply_alpha: bool
) -> None:
    """Loss on the input gradients (u0's, as a force loss is, and alpha's), differentiated to
    every operand."""
    ops = make_operands(lmax, focus_dim, n_focus, 5, n_layers, seed=5)
    mask = (True, apply_alpha, True, True, n_layers > 1)  # one layer has no gate weights
    got, want = _force_loss_second_order(ops, mask, lmax, focus_dim, apply_alpha)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 3e-6)


def _force_loss_second_order(
    ops: Operands, mask: tuple[bool, ...], lmax: int, focus_dim: int, apply_alpha: bool
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Gradients of ``<∂(x_local·c)/∂u0, p> + <∂(x_local·c)/∂alpha, q>`` (the alpha term where
    ``mask`` has alpha) with respect to the operands in ``mask``: the fused op in fp32 and the
    reference in float64, for random cotangent ``c`` and probes ``p``, ``q``."""
    n_focus, n_edge, row = ops[0].shape
    grad_out = torch.randn(n_edge, n_focus, row, device=ops[0].device)
    probes = (torch.randn_like(ops[0]), torch.randn_like(ops[1]))

    def second(inputs: Operands, fused: bool) -> tuple[torch.Tensor, ...]:
        if fused:
            x_local = so2_mixing_stack(*inputs, lmax, focus_dim, apply_alpha)[0]
        else:
            x_local = mixing_stack_reference(*inputs, lmax, focus_dim, apply_alpha)[0]
        dtype = x_local.dtype
        probed = inputs[: 2 if mask[1] else 1]
        grads = torch.autograd.grad(x_local, probed, grad_out.to(dtype), create_graph=True)
        loss = sum((g * p.to(dtype)).sum() for g, p in zip(grads, probes, strict=False))
        wrt = [t for t in inputs if t.requires_grad]
        return torch.autograd.grad(loss, wrt)

    return second(_float(ops, mask), True), second(_double(ops, mask), False)


@pytest.mark.parametrize(("lmax", "focus_dim", "n_focus"), [(2, 32, 2), (3, 96, 1), (5, 128, 1)])
def test_fast_tier_against_float64(
    poisoned_alloc: None,
    lmax: int,
    focus_dim: int,
    n_focus: int,
) -> None:
    """fp16x3 keeps fp32-level accuracy: a few 2^-22 steps per GEMM, never NaN."""
    ops = make_operands(lmax, focus_dim, n_focus, 9, 3, seed=7)
    report = measure_stack_error(*ops, lmax, focus_dim, True, "fp16x3")
    assert not report.non_finite
    assert report.x_local < 4e-6
    assert report.grad_u0 < 4e-6
    assert report.grad_alpha < 4e-6
    exact = measure_stack_error(*ops, lmax, focus_dim, True, "ieee")
    assert exact.x_local < 1e-6


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_alpha_zero_edges_get_their_gradient(poisoned_alloc: None, precision: str) -> None:
    """``d x_local / d alpha = out`` holds at alpha = 0 too (an edge the competition switched
    off): no division by alpha anywhere, so no NaN and the reference's value."""
    ops = make_operands(2, 32, 2, 11, 3, seed=23)
    alpha = ops[1].clone()
    alpha[::3, 0] = 0.0
    alpha[4] = 0.0
    ops = (ops[0], alpha, *ops[2:])
    got_in, ref_in = _float(ops, FORCE_GRADS), _double(ops, FORCE_GRADS)
    got = so2_mixing_stack(*got_in, 2, 32, True, precision)[0]
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, got_in[:2], grad_out)
    ref = mixing_stack_reference(*ref_in, 2, 32, True)[0]
    ref_grads = torch.autograd.grad(ref, ref_in[:2], grad_out.double())
    tol = 4e-6 if precision == "fp16x3" else 2e-6
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert bool(torch.isfinite(g).all())
        assert_normwise_close(g, r, tol)
    assert_normwise_close(got_grads[1][alpha == 0], ref_grads[1][alpha == 0], tol)


def test_alpha_zero_second_order() -> None:
    """The differentiable backward (a force loss) at alpha = 0 edges, against float64."""
    ops = make_operands(2, 32, 2, 5, 3, seed=29)
    alpha = ops[1].clone()
    alpha[1] = 0.0
    alpha[3, 1] = 0.0
    got, want = _force_loss_second_order((ops[0], alpha, *ops[2:]), ALL_GRADS, 2, 32, True)
    for g, w in zip(got, want, strict=True):
        assert bool(torch.isfinite(g).all())
        assert_normwise_close(g, w, 3e-6)


def test_zero_edges() -> None:
    ops = _float(make_operands(2, 32, 2, 0, 3), ALL_GRADS)
    x_local, z_all, u_final = so2_mixing_stack(*ops, 2, 32, True)
    assert x_local.shape == (0, 2, 224)
    assert z_all.shape == (2, 2, 0, 224)
    assert u_final.shape == (2, 0, 224)
    grads = torch.autograd.grad(x_local.sum(), ops)
    for g, t in zip(grads, ops, strict=True):
        assert g.shape == t.shape
    assert all(bool((g == 0).all()) for g in grads[2:])


def test_bad_inputs() -> None:
    ops = make_operands(2, 32, 1, 3, 2)
    with pytest.raises(UnsupportedInputError, match="float32"):
        so2_mixing_stack(*_double(ops, (False,) * 5), 2, 32, True)
    with pytest.raises(ValueError, match="alpha must have shape"):
        so2_mixing_stack(ops[0], ops[1].T, *ops[2:], 2, 32, True)
    with pytest.raises(ValueError, match="u0 must be"):
        so2_mixing_stack(*ops, 3, 32, True)
    with pytest.raises(ValueError, match="unknown stack precision"):
        so2_mixing_stack(*ops, 2, 32, True, "tf32")
    with pytest.raises(ValueError, match="focus_dim must be"):
        so2_mixing_stack(*make_operands(1, 16, 1, 3, 2), 1, 16, True)


def test_backward_op_bad_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standalone backward op refuses what its forward refuses, and every cotangent it hands
    to a kernel is checked; the fast tier never falls back to an exact reference silently."""
    ops = make_operands(2, 32, 1, 3, 2)
    outs = so2_mixing_stack(*ops, 2, 32, True)
    cots = [torch.randn_like(t) for t in outs]

    def backward(*cot: torch.Tensor, precision: str = "ieee") -> object:
        return mixing_stack_backward(
            cot[0], *outs[1:], ops[1], ops[0], *ops[2:], cot[1], cot[2], 2, 32, True, False,
            precision,
        )  # fmt: skip

    with pytest.raises(UnsupportedInputError, match="float32 for 'grad_z'"):
        backward(cots[0], cots[1].double(), cots[2])
    small = make_operands(1, 16, 1, 3, 2)
    small_outs = mixing_stack_reference(*small, 1, 16, True)
    with pytest.raises(ValueError, match="focus_dim must be"):
        mixing_stack_backward(
            torch.randn_like(small_outs[0]), *small_outs[1:], small[1], small[0], *small[2:], None,
            None, 1, 16, True, False,
        )  # fmt: skip
    monkeypatch.setattr(mixing_stack_module, "use_triton", lambda *tensors: False)
    monkeypatch.setattr(mixing_stack_backward_module, "use_triton", lambda *tensors: False)
    with pytest.raises(UnsupportedInputError, match="needs the Triton path"):
        so2_mixing_stack(*ops, 2, 32, True, "fp16x3")
    with pytest.raises(UnsupportedInputError, match="needs the Triton path"):
        backward(*cots, precision="fp16x3")


def test_opcheck() -> None:
    ops = _float(make_operands(1, 32, 2, 5, 2), ALL_GRADS)
    torch.library.opcheck(
        torch.ops.so2kernels.so2_mixing_stack.default, (*ops, 1, 32, True, "ieee")
    )
    x_local, z_all, u_final = (t.detach() for t in so2_mixing_stack(*ops, 1, 32, True))
    plain = [t.detach() for t in ops]
    torch.library.opcheck(
        torch.ops.so2kernels.so2_mixing_stack_bwd.default,
        (torch.randn_like(x_local), z_all, u_final, plain[1], plain[0], *plain[2:],
         None, None, 1, 32, True, True, "ieee"),
    )  # fmt: skip


@pytest.mark.parametrize(("precision", "grad_mask"), [("ieee", ALL_GRADS), ("fp16x3", FORCE_GRADS)])
def test_compile_aot_eager(precision: str, grad_mask: tuple[bool, ...]) -> None:
    """Traces whole; the fast tier's host-built tensor descriptors pass through tracing too."""
    ops = _float(make_operands(1, 32, 1, 5, 2), grad_mask)
    inputs = [t for t, m in zip(ops, grad_mask, strict=True) if m]

    def f(*operands: torch.Tensor) -> torch.Tensor:
        u0, alpha, w0, w1, gw = operands
        return so2_mixing_stack(u0, alpha, w0, w1, gw, 1, 32, True, precision)[0].square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*ops), inputs)
    want = torch.autograd.grad(f(*ops), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_backward_op_weight_grads_match_autograd() -> None:
    """The standalone backward op with weight gradients equals reference autograd."""
    ops = make_operands(2, 32, 1, 7, 3, seed=11)
    x_local, z_all, u_final = so2_mixing_stack(*ops, 2, 32, True)
    grad_out = torch.randn_like(x_local)
    grads = mixing_stack_backward(
        grad_out, z_all, u_final, ops[1], ops[0], *ops[2:], None, None, 2, 32, True, True
    )
    ref_in = _double(ops, ALL_GRADS)
    ref = mixing_stack_reference(*ref_in, 2, 32, True)[0]
    want = torch.autograd.grad(ref, ref_in, grad_out.double())
    for g, w in zip(grads, want, strict=True):
        assert_normwise_close(g, w, 2e-6)


@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_layers", "apply_alpha"),
    [(2, 32, 2, 3, True), (1, 96, 1, 2, False), (2, 64, 1, 1, True)],
)
def test_fast_backward_op_every_input(
    poisoned_alloc: None,
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_layers: int,
    apply_alpha: bool,
) -> None:
    """The fp16x3 traversal with weight gradients and cotangents on all three outputs (split
    cotangent planes, in-kernel z_all cotangent, alpha partials) against float64 autograd."""
    ops = make_operands(lmax, focus_dim, n_focus, 37, n_layers, seed=19)
    outs = so2_mixing_stack(*ops, lmax, focus_dim, apply_alpha, "fp16x3")
    cots = [torch.randn_like(t) for t in outs]
    grads = mixing_stack_backward(
        cots[0], *outs[1:], ops[1], ops[0], *ops[2:], cots[1], cots[2], lmax, focus_dim,
        apply_alpha, True, "fp16x3",
    )  # fmt: skip
    mask = (True, apply_alpha, True, True, n_layers > 1)
    ref_in = _double(ops, mask)
    ref = mixing_stack_reference(*ref_in, lmax, focus_dim, apply_alpha)
    loss = torch.stack([(r * c.double()).sum() for r, c in zip(ref, cots, strict=True)]).sum()
    want = torch.autograd.grad(loss, [t for t in ref_in if t.requires_grad])
    got = [g for g, m in zip(grads, mask, strict=True) if m]
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 4e-6)
    if not apply_alpha:
        assert bool((grads[1] == 0).all())


def test_fast_tier_zero_edges() -> None:
    ops = _float(make_operands(2, 32, 2, 0, 3), ALL_GRADS)
    x_local, _, _ = so2_mixing_stack(*ops, 2, 32, True, "fp16x3")
    grads = torch.autograd.grad(x_local.sum(), ops)
    for g, t in zip(grads, ops, strict=True):
        assert g.shape == t.shape
    assert all(bool((g == 0).all()) for g in grads[2:])


def test_fast_tier_refuses_weights_beyond_the_fp16_range() -> None:
    """An fp16 head cannot hold |w| >= 65504: the tier says so instead of returning NaN."""
    ops = make_operands(1, 32, 1, 3, 2)
    huge_w0 = ops[2].clone()
    huge_w0[0, 0, 0, 0] = 1.0e5
    with pytest.raises(UnsupportedInputError, match="65504"):
        so2_mixing_stack(ops[0], ops[1], huge_w0, *ops[3:], 1, 32, True, "fp16x3")
    nan_gw = ops[4].clone()
    nan_gw[0, 0, 0, 0] = math.nan
    with pytest.raises(UnsupportedInputError, match="finite weights"):
        so2_mixing_stack(*ops[:4], nan_gw, 1, 32, True, "fp16x3")
    trainable = huge_w0.requires_grad_()  # never cached: checked at every build
    for _ in range(2):
        with pytest.raises(UnsupportedInputError, match="65504"):
            so2_mixing_stack(ops[0], ops[1], trainable, *ops[3:], 1, 32, True, "fp16x3")


def test_fast_tier_refuses_a_differentiable_backward() -> None:
    """create_graph would compose exact fp32 closed forms: refused, not silently exact."""
    ops = _float(make_operands(1, 32, 1, 3, 2), FORCE_GRADS)
    x_local = so2_mixing_stack(*ops, 1, 32, True, "fp16x3")[0]
    with pytest.raises(UnsupportedInputError, match="no double backward"):
        torch.autograd.grad(x_local.sum(), ops[0], create_graph=True)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts one element past a 16-byte boundary."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def test_fast_tier_misaligned_views() -> None:
    """Tensor descriptors need 16-byte aligned bases: views at odd offsets (activation, output
    cotangent) give the same bits as aligned tensors."""
    ops = make_operands(2, 32, 2, 21, 3, seed=5)
    cot = torch.randn(21, 2, ops[0].shape[2])
    results = []
    for shift in (False, True):
        u0 = (_misaligned(ops[0]) if shift else ops[0].clone()).requires_grad_()
        x_local = so2_mixing_stack(u0, *ops[1:], 2, 32, True, "fp16x3")[0]
        grad = _misaligned(cot) if shift else cot
        results.append([x_local.detach(), *torch.autograd.grad(x_local, u0, grad)])
    for aligned, shifted in zip(*results, strict=True):
        assert torch.equal(aligned, shifted)


def test_fast_tier_single_focus_cotangent_with_odd_size_one_stride() -> None:
    """An F = 1 cotangent made by a permute is contiguous yet strides its focus axis by 1 (torch
    ignores size-1 strides), which a tensor descriptor refuses: the backward must not care."""
    ops = make_operands(2, 32, 1, 21, 3, seed=9)
    row = ops[0].shape[2]
    cot = torch.randn(21, 1, row)
    permuted = cot.view(21, row, 1).permute(0, 2, 1)
    assert permuted.is_contiguous() and permuted.stride() == (row, 1, 1)
    grads = []
    for grad in (cot, permuted):
        u0 = ops[0].clone().requires_grad_()
        x_local = so2_mixing_stack(u0, *ops[1:], 2, 32, True, "fp16x3")[0]
        grads.append(torch.autograd.grad(x_local, u0, grad)[0])
    assert torch.equal(grads[0], grads[1])


# Cached weight operands (fp16x3 planes, transposed copies): built once per weight version.


def _step(ops: Operands, precision: str) -> list[torch.Tensor]:
    """One force-path step: outputs and the (u0, alpha) gradients of a fixed cotangent."""
    u0, alpha = (t.detach().clone().requires_grad_() for t in ops[:2])
    x_local = so2_mixing_stack(u0, alpha, *ops[2:], 2, 32, True, precision)[0]
    cot = torch.linspace(-1.0, 1.0, x_local.numel()).view_as(x_local)
    return [x_local.detach(), *torch.autograd.grad(x_local, (u0, alpha), cot)]


def test_weight_operands_cached_until_the_weight_changes() -> None:
    w = torch.randn(3, 2, 32, 48)
    fast = StackPrecision.FAST
    planes = weight_operands(w, fast)
    assert weight_operands(w, fast) is planes
    for got, want in zip(planes, split_fp16x3(w), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(
        weight_operands(w, fast, transposed=True), split_fp16x3(w.mT.contiguous()), strict=True
    ):
        assert torch.equal(got, want)
    exact_t = weight_operands(w, StackPrecision.EXACT, transposed=True)
    assert exact_t[0] is exact_t[1] and torch.equal(exact_t[0], w.mT.contiguous())
    w.mul_(-2.0)  # in place: same tensor, new version
    assert torch.equal(weight_operands(w, fast)[0], split_fp16x3(w)[0])
    assert torch.equal(weight_operands(w, StackPrecision.EXACT, transposed=True)[0], w.mT)
    w.data = torch.randn(3, 2, 32, 48)  # new storage behind the same tensor object
    assert torch.equal(weight_operands(w, fast)[1], split_fp16x3(w)[1])


def test_weight_operand_cache_lets_dead_weights_go() -> None:
    import gc

    before = len(mixing_stack_kernels._operand_cache)
    w = torch.randn(2, 1, 32, 32)
    weight_operands(w, StackPrecision.FAST)
    assert len(mixing_stack_kernels._operand_cache) == before + 1
    del w
    gc.collect()
    assert len(mixing_stack_kernels._operand_cache) == before


def test_trainable_weights_are_never_cached() -> None:
    """A write through ``.data`` bumps no version counter: a weight that requires grad (where
    EMA swaps and hand-written updates do that) is split afresh at every call."""
    w = torch.randn(3, 2, 32, 48, requires_grad=True)
    before = len(mixing_stack_kernels._operand_cache)
    first = weight_operands(w, StackPrecision.FAST)
    w.data.mul_(-2.0)
    for got, want in zip(
        weight_operands(w, StackPrecision.FAST), split_fp16x3(w.detach()), strict=True
    ):
        assert torch.equal(got, want)
    assert not torch.equal(first[0], split_fp16x3(w.detach())[0])
    exact_t = weight_operands(w, StackPrecision.EXACT, transposed=True)
    assert torch.equal(exact_t[0], w.detach().mT)
    assert len(mixing_stack_kernels._operand_cache) == before


def test_a_cached_transpose_never_keeps_its_weight_alive() -> None:
    """A weight stored transposed (not a view) has a contiguous transpose that is a view of it;
    the cache stores a copy, so the entry still dies with the weight."""
    import gc

    w = torch.randn(3, 2, 48, 32).mT.clone()  # transposed strides, its own storage
    assert w._base is None and w.mT.is_contiguous()
    before = len(mixing_stack_kernels._operand_cache)
    head, _ = weight_operands(w, StackPrecision.EXACT, transposed=True)
    assert torch.equal(head, w.mT) and head.untyped_storage().data_ptr() != w.data_ptr()
    assert len(mixing_stack_kernels._operand_cache) == before + 1
    del w, head
    gc.collect()
    assert len(mixing_stack_kernels._operand_cache) == before


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_steps_reuse_weight_operands_and_see_updates(
    monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """Steps on frozen weights split them once; an in-place update (an optimiser step) is seen
    by the next step exactly as by a fresh copy of the updated weights."""
    splits: list[tuple[int, ...]] = []
    original = mixing_stack_kernels.split_fp16x3

    def counting(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        splits.append(tuple(w.shape))
        return original(w)

    monkeypatch.setattr(mixing_stack_kernels, "split_fp16x3", counting)
    ops = make_operands(2, 32, 1, 9, 3, seed=23)
    first = _step(ops, precision)
    n_first = len(splits)
    assert n_first == (6 if precision == "fp16x3" else 0)  # 3 forward, 3 more transposed
    for got, want in zip(_step(ops, precision), first, strict=True):
        assert torch.equal(got, want)
    assert len(splits) == n_first
    with torch.no_grad():
        ops[2].mul_(1.5)
        ops[4].add_(0.25)
    updated = _step(ops, precision)
    fresh = _step((*ops[:2], *(t.clone() for t in ops[2:])), precision)  # type: ignore[arg-type]
    for got, want in zip(updated, fresh, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(updated[0], first[0])


# Compiled mode without a GPU: the interpreter accepts code that the compiler rejects (e.g. a
# variable changing shape inside a runtime branch), so compile every kernel for sm_90 ahead of
# time. Triton ships ptxas, so this runs on the CPU-only CI.

_SCALARS = ("n_edge", "n_focus", "layer")
_WEIGHTS = {"w", "w_lo", "wt", "wt_lo", "gw", "gw_lo", "gwt", "gwt_lo"}
"""Operands that are fp16 (head, tail) pairs in the fast tier."""

_Variant = tuple[str, dict[str, int]]
_BLOCKS = [{"M1_BLOCK": m1, "FINAL": fin} for m1 in (0, 1) for fin in (0, 1)]
_EXACT_VARIANTS: list[_Variant] = [
    *(("block_fwd_kernel", {**b, "APPLY_ALPHA": 1}) for b in _BLOCKS),
    ("gate_fwd_kernel", {"HAS_RES": 1, "ALL_ROWS": 0, "STORE_SIG": 1}),
    ("gate_fwd_kernel", {"HAS_RES": 0, "ALL_ROWS": 1, "STORE_SIG": 0}),
    ("gate_bwd_kernel", {"RECOVER": 1}),
    ("scalar_bwd_kernel", {"RECOVER": 1}),
    *(("block_bwd_kernel", {**b, "APPLY_ALPHA": 1, "ALPHA_PARTIALS": b["FINAL"]})
      for b in _BLOCKS),
]  # fmt: skip
_FAST_VARIANTS: list[_Variant] = [
    *(("block_fwd_desc_kernel", {**b, "APPLY_ALPHA": 1}) for b in _BLOCKS),
    ("gate_fwd_kernel", {"HAS_RES": 1, "ALL_ROWS": 0, "STORE_SIG": 1}),
    *(
        (name, {"HAS_GZ_UP": on, "RECOVER": on})
        for name in ("gate_bwd_split_kernel", "scalar_bwd_split_kernel")
        for on in (0, 1)
    ),
    *(("block_bwd_desc_kernel", {**b, "APPLY_ALPHA": b["FINAL"], "ALPHA_PARTIALS": b["FINAL"]})
      for b in _BLOCKS),
]  # fmt: skip
"""Every kernel variant each tier launches (the fast traversal: split cotangent planes, alpha
partials, descriptor-fed persistent block GEMMs)."""


def _argument_type(arg: str, flags: dict[str, int], fast: bool, tile: tuple[int, ...]) -> str:
    """Compile-time type of kernel argument ``arg`` (``tile`` = (BLOCK_M, BLOCK_N, BLOCK_K))."""
    block_m, block_n, block_k = tile
    if arg in _SCALARS:
        return "i32"
    if arg == "u_desc":
        return f"tensordesc<fp32[{block_m},{block_k}]>"
    if arg == "a_desc":
        if flags["FINAL"]:
            return f"tensordesc<fp32[{block_m},1,{block_k}]>"
        return f"tensordesc<fp16[{block_m},{block_k}]>"
    if arg.endswith("_desc"):
        return f"tensordesc<fp16[{block_k},{block_n}]>"
    name = arg.removesuffix("_ptr")
    return "*fp16" if name == "gzs" or (fast and name in _WEIGHTS) else "*fp32"


def compile_all_for_sm90(fast: bool) -> int:
    """Compile every kernel variant for sm_90 (run in a process without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from so2kernels.mixing_stack_kernels import fallback_tile

    cfg = fallback_tile(StackPrecision.FAST if fast else StackPrecision.EXACT)
    tile = (cfg.block_m, cfg.block_n, cfg.block_k)
    n_compiled = 0
    for kernel_name, flags in _FAST_VARIANTS if fast else _EXACT_VARIANTS:
        kernel = getattr(mixing_stack_kernels, kernel_name)
        consts = {
            "L": 2, "FD": 96, **flags,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
        }  # fmt: skip
        if "FAST" in kernel.arg_names:
            consts["FAST"] = fast
        signature = {
            arg: _argument_type(arg, flags, fast, tile)
            for arg in kernel.arg_names
            if arg not in consts
        }
        source = ASTSource(
            fn=kernel,
            signature={**signature, **dict.fromkeys(consts, "constexpr")},
            constexprs=consts,
        )
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"], kernel_name
        n_compiled += 1
    return n_compiled


def test_tile_table_gate_backward_entry_and_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate-row backward has its own entry where the table was swept for it; tables without
    one hand it the gate kernels' tile, and shapes without either get the fallback."""
    fast = StackPrecision.FAST
    table = {"gate|cf128|l2|fp16x3": [64, 64, 32, 4, 3], "gbwd|cf128|l2|fp16x3": [32, 64, 32, 4, 3],
             "gate|cf64|l2|fp16x3": [64, 32, 32, 4, 2]}  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(mixing_stack_kernels, "_load_table", lambda device_name: table)
    cuda = torch.device("cuda")

    def tile(kind: str, focus_dim: int) -> tuple[int, ...]:
        cfg = mixing_stack_kernels.tile_config(kind, focus_dim, 2, fast, cuda)
        return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)

    assert tile("gbwd", 128) == (32, 64, 32, 4, 3)
    assert tile("gate", 128) == (64, 64, 32, 4, 3)
    assert tile("gbwd", 64) == (64, 32, 32, 4, 2)
    fallback = mixing_stack_kernels.fallback_tile(fast)
    assert tile("gbwd", 96) == tile("bwd", 64) == (
        fallback.block_m, fallback.block_n, fallback.block_k, fallback.num_warps,
        fallback.num_stages,
    )  # fmt: skip


def test_tile_table_overlay_of_the_running_triton_release(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Entries swept under another Triton release live in that release's overlay and override
    the base table's only where the running Triton is that release."""
    monkeypatch.setattr(mixing_stack_kernels, "TABLES_DIR", tmp_path)
    monkeypatch.delenv("SO2_STACK_TABLE", raising=False)
    device = "NVIDIA Test GPU"
    base = {"fwd|cf128|l2|fp16x3": [64, 128, 32, 4, 3], "bwd|cf128|l2|fp16x3": [128, 128, 64, 8, 3]}
    overlay = {"bwd|cf128|l2|fp16x3": [64, 128, 32, 4, 3]}
    mixing_stack_kernels.stack_table_path(device).write_text(
        json.dumps({"meta": {"triton": "3.6.0"}, "configs": base})
    )
    mixing_stack_kernels.stack_overlay_path(device, "3.7").write_text(
        json.dumps({"meta": {"triton": "3.7.1"}, "configs": overlay})
    )
    for release, expected in (("3.6", base), ("3.7", {**base, **overlay})):
        monkeypatch.setattr(mixing_stack_kernels, "triton_release", lambda r=release: r)
        mixing_stack_kernels._load_table.cache_clear()
        assert mixing_stack_kernels._load_table(device) == expected
    mixing_stack_kernels._load_table.cache_clear()

    from benchmarks.kernels_mixing_stack import _sweep_target, _untuned, _written

    # A sweep under the base table's release rewrites the base; under another, its overlay,
    # which keeps its own entries and gains the swept ones (never copies of the base's).
    monkeypatch.setattr(mixing_stack_kernels, "triton_release", lambda: "3.6")
    assert _sweep_target(device) == (mixing_stack_kernels.stack_table_path(device), None)
    monkeypatch.setattr(mixing_stack_kernels, "triton_release", lambda: "3.8")
    target, kept = _sweep_target(device)
    assert target == mixing_stack_kernels.stack_overlay_path(device, "3.8")
    assert kept == set()
    swept = {"fwd|cf128|l2|fp16x3": [128, 128, 64, 8, 3]}
    assert _written({**base, **swept}, kept, set(swept)) == swept
    # --sweep-skip-tuned under another release skips only the shapes its overlay holds: the
    # base's entries were swept under a release that schedules the kernels differently.
    fast = [StackPrecision.FAST]
    own = {f"{kind}|cf128|l2|fp16x3" for kind in ("fwd", "gate", "gbwd", "bwd", "fbwd")}
    shapes = [(2, 128, 1), (2, 64, 1), (3, 128, 1)]
    assert _untuned(shapes, own, fast) == [(2, 64, 1), (3, 128, 1)]
    assert _untuned(shapes, set(), fast) == shapes


@pytest.mark.slow
@pytest.mark.parametrize(("fast", "n_variants"), [(False, 12), (True, 13)])
def test_kernels_compile_for_sm90(fast: bool, n_variants: int) -> None:
    assert compiled_count("test_mixing_stack", f"compile_all_for_sm90({fast})") == n_variants


# GPU (the lead runs these on the H200)


def _edge_sample(ops: Operands, edges: torch.Tensor) -> Operands:
    u0, alpha, w0, w1, gw = ops
    return u0[:, edges], alpha[edges], w0, w1, gw


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
@pytest.mark.parametrize(("lmax", "focus_dim", "n_focus"), [(2, 128, 1), (3, 64, 2), (2, 96, 1)])
def test_gpu_realistic_size(precision: str, lmax: int, focus_dim: int, n_focus: int) -> None:
    """E = 1e5: values and force-path gradients vs fp64 on sampled edges; no NaN anywhere.

    The stack acts on every edge independently, so the fp64 reference on a sample of edges is
    the exact ground truth for those edges.
    """
    n_edge = 100_003
    ops = make_operands(lmax, focus_dim, n_focus, n_edge, 3, seed=13, device="cuda")
    ops[1][::997, 0] = 0.0  # edges the competition switched off (alpha = 0) keep their gradient
    inputs = _float(ops, FORCE_GRADS)
    x_local, z_all, u_final = so2_mixing_stack(*inputs, lmax, focus_dim, True, precision)
    grad_out = torch.randn_like(x_local)
    grad_u0, grad_alpha = torch.autograd.grad(x_local, inputs[:2], grad_out)
    for t in (x_local, z_all, u_final, grad_u0, grad_alpha):
        assert bool(torch.isfinite(t).all())
    edges = torch.cat(
        [torch.arange(0, 64), torch.randint(0, n_edge, (512,)), torch.arange(0, n_edge, 997)[:64],
         torch.arange(n_edge - 64, n_edge)]
    ).cuda()  # fmt: skip
    ref_in = _double(_edge_sample(ops, edges), FORCE_GRADS)
    ref = mixing_stack_reference(*ref_in, lmax, focus_dim, True)
    ref_grads = torch.autograd.grad(ref[0], ref_in[:2], grad_out[edges].double())
    tol = 4e-6 if precision == "fp16x3" else 1e-6
    assert_normwise_close(x_local[edges], ref[0], tol)
    assert_normwise_close(u_final[:, edges], ref[2], tol)
    assert_normwise_close(grad_u0[:, edges], ref_grads[0], 2 * tol)
    assert_normwise_close(grad_alpha[edges], ref_grads[1], 2 * tol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_gpu_training_backward(precision: str) -> None:
    """E = 20k on the GPU: every operand's gradient (the weights' sum over all edges) against
    float64, in both tiers."""
    lmax, focus_dim, n_focus = 2, 64, 2
    ops = make_operands(lmax, focus_dim, n_focus, 20_011, 3, seed=31, device="cuda")
    inputs = _float(ops, ALL_GRADS)
    x_local = so2_mixing_stack(*inputs, lmax, focus_dim, True, precision)[0]
    grad_out = torch.randn_like(x_local)
    got = torch.autograd.grad(x_local, inputs, grad_out)
    ref_in = _double(ops, ALL_GRADS)
    ref = mixing_stack_reference(*ref_in, lmax, focus_dim, True)[0]
    want = torch.autograd.grad(ref, ref_in, grad_out.double())
    tol = 2e-5 if precision == "fp16x3" else 1e-5
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, tol)


@pytest.mark.gpu
def test_gpu_second_order_force_loss() -> None:
    """The force-loss double backward at E = 20k on the GPU, every operand, against float64."""
    ops = make_operands(2, 64, 2, 20_011, 3, seed=37, device="cuda")
    got, want = _force_loss_second_order(ops, ALL_GRADS, 2, 64, True)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-5)


@pytest.mark.gpu
def test_gpu_capture_reads_cached_weight_operands() -> None:
    """A CUDA graph captured after eager warm-up replays the fast-tier step exactly; a weight
    first seen during capture is split inside the graph and kept out of the cache (its planes
    would otherwise live in the graph's private pool)."""
    ops = make_operands(2, 32, 1, 515, 3, seed=29, device="cuda")
    u0 = ops[0].clone().requires_grad_()
    cot = torch.randn(515, 1, ops[0].shape[2], device="cuda")

    def step(w0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = so2_mixing_stack(u0, ops[1], w0, *ops[3:], 2, 32, True, "fp16x3")[0]
        return x, torch.autograd.grad(x, u0, cot)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = step(ops[2])
    torch.cuda.current_stream().wait_stream(side)
    for weights in (ops[2], ops[2].clone()):  # cached before capture, then first seen inside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(weights)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    assert weights not in mixing_stack_kernels._operand_cache


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_int64_offsets() -> None:
    """F·E·ROW beyond 2^31 elements: the last edges must still be right (int64 offsets)."""
    lmax, focus_dim, n_focus = 2, 128, 1
    row = (3 * lmax + 1) * focus_dim
    n_edge = (2**31) // row + 4097
    ops = make_operands(lmax, focus_dim, n_focus, 8, 2, seed=17, device="cuda")
    u0 = torch.randn(n_focus, n_edge, row, device="cuda")
    alpha = torch.rand(n_edge, n_focus, device="cuda") + 0.02
    x_local, _, _ = so2_mixing_stack(u0, alpha, *ops[2:], lmax, focus_dim, True)
    edges = torch.arange(n_edge - 256, n_edge, device="cuda")
    _, _, w0, w1, gw = _double(ops, (False,) * 5)
    ref = mixing_stack_reference(
        u0[:, edges].double(), alpha[edges].double(), w0, w1, gw, lmax, focus_dim, True
    )[0]
    assert_normwise_close(x_local[edges], ref, 1e-6)
