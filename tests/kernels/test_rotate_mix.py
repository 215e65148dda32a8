"""so2_rotate_mix: fused path (interpreter on CPU) against the float64 reference — values, first
and second order — over the regimes, plus golden slot orientation, opcheck and torch.compile."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import import_module
from typing import Any

import numpy as np
import pytest
import torch

from so2kernels._dispatch import UnsupportedInputError, use_triton
from so2kernels._layout import n_coeff, n_kernel_slots, reduced_to_packed
from so2kernels.rotate_mix import (
    launch_rotate_mix_fwd,
    mix_degrees_reference,
    rotate_mix,
    rotate_mix_reference,
)
from so2kernels.rotate_mix_backward import (
    launch_rotate_mix_bwd,
    rotate_mix_backward,
    rotate_mix_backward_reference,
)
from so2kernels.segment import csr_from_index
from so2kernels.tiles import LaunchTiles
from tests.conftest import shared_path
from tests.offline_compile import compiled_count

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
fused_only = pytest.mark.skipif(
    not use_triton(torch.empty(1, device=DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1"
)


@dataclass(frozen=True)
class Case:
    lmax: int
    n_focus: int
    focus_dim: int
    rank: int
    n_node: int = 5
    n_edge: int = 13
    extra_dw: int = 0  # Wigner operand wider than (L+1)²: only the leading block may be read
    strided_x: bool = False  # x as a row-slice view of wider node features

    def __str__(self) -> str:
        return (
            f"L{self.lmax}-F{self.n_focus}x{self.focus_dim}-R{self.rank}-N{self.n_node}"
            f"-E{self.n_edge}-dw{self.extra_dw}{'-strided' if self.strided_x else ''}"
        )


@dataclass
class Operands:
    x: torch.Tensor
    src: torch.Tensor
    src_order: torch.Tensor
    src_rowptr: torch.Tensor
    wigner: torch.Tensor
    kc: torch.Tensor
    cb: torch.Tensor
    lmax: int
    n_focus: int
    rank: int

    def args(self) -> tuple[Any, ...]:
        return (self.x, self.src, self.src_order, self.src_rowptr, self.wigner, self.kc, self.cb,
                self.lmax, self.n_focus, self.rank)  # fmt: skip

    def floats(self) -> list[torch.Tensor]:
        return [self.x, self.wigner, self.kc, self.cb]

    def cast(self, dtype: torch.dtype) -> Operands:
        return replace(self, **{k: getattr(self, k).to(dtype) for k in ("x", "wigner", "kc", "cb")})


def make_operands(case: Case, seed: int = 0, device: str = DEVICE) -> Operands:
    """float32 operands drawn in float64 (so a float64 copy holds identical values)."""
    gen = torch.Generator().manual_seed(seed)
    dim, c_wide = n_coeff(case.lmax), case.n_focus * case.focus_dim

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return t.to(torch.float32).to(device)

    x = (
        draw(case.n_node, dim + 2, c_wide)[:, 1 : dim + 1]
        if case.strided_x
        else draw(case.n_node, dim, c_wide)
    )
    # Sources avoid the last node, so one node always has no outgoing edge.
    src = torch.randint(0, max(case.n_node - 1, 1), (case.n_edge,), generator=gen).to(device)
    order, row_ptr = csr_from_index(src, case.n_node)
    dw = dim + case.extra_dw
    wigner = draw(case.n_edge, dw, dw, scale=0.5)
    if case.rank == 0:
        kc = draw(case.n_edge, case.lmax + 1, c_wide)
        cb = torch.empty(0, c_wide, device=device)
    else:
        kc = draw(case.n_edge, n_kernel_slots(case.lmax) * case.rank, scale=0.5)
        cb = draw(case.rank, c_wide)
    return Operands(x, src, order, row_ptr, wigner, kc, cb, case.lmax, case.n_focus, case.rank)


def assert_close_normwise(got: torch.Tensor, want: torch.Tensor, rel: float = 3e-6) -> None:
    """Max abs error against the float64 truth, relative to its largest magnitude."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    if want.numel() == 0:
        return
    scale = max(want.abs().max().item(), 1e-30)
    err = (got.double() - want).abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3e} > {rel:g} × {scale:.3e}"


CASES = [
    Case(1, 1, 32, 0),
    Case(1, 2, 32, 1, extra_dw=5),
    Case(2, 3, 32, 2, strided_x=True),
    Case(2, 1, 96, 1),  # Cf 96: 128 lanes, 32 masked
    Case(2, 4, 32, 1, extra_dw=16),  # the tiny-fused model's shape, lmax-6 Wigner cache
    Case(3, 2, 64, 3),
    Case(3, 1, 96, 0, extra_dw=7),
    Case(2, 2, 96, 4),
    Case(3, 1, 128, 1),
    Case(4, 1, 32, 3, n_edge=9, n_node=4),
    Case(5, 2, 32, 1, n_edge=7, n_node=3),
    Case(6, 1, 32, 2, n_edge=7, n_node=3),
    Case(6, 2, 32, 0, n_edge=6, n_node=4),
    Case(2, 1, 32, 1, n_edge=1, n_node=1),  # single edge, single node
    Case(2, 2, 32, 2, n_edge=3, n_node=8),  # mostly nodes with no edges
]


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_match_reference(case: Case) -> None:
    ops = make_operands(case)
    ref = ops.cast(torch.float64)
    for t in ops.floats() + ref.floats():
        t.requires_grad_(True)
    u = rotate_mix(*ops.args())
    u_ref = rotate_mix_reference(*ref.args())
    assert_close_normwise(u, u_ref)

    grad_u = torch.randn(u.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    n_leaves = 4 if case.rank else 3
    grads = torch.autograd.grad(u, ops.floats()[:n_leaves], grad_u.to(DEVICE, torch.float32))
    grads_ref = torch.autograd.grad(u_ref, ref.floats()[:n_leaves], grad_u.to(DEVICE))
    for got, want in zip(grads, grads_ref, strict=True):
        assert_close_normwise(got, want, rel=5e-6)
    assert_structural_wigner_grad(grads[1], case.lmax)


def assert_structural_wigner_grad(grad_wigner: torch.Tensor, lmax: int) -> None:
    """Entries of the Wigner operand the op does not read have exactly zero gradient."""
    structural = torch.zeros_like(grad_wigner, dtype=torch.bool)
    degrees = list(range(lmax + 1)) + list(range(1, lmax + 1)) * 2
    for r, degree in zip(reduced_to_packed(lmax), degrees, strict=True):
        structural[:, r, degree * degree : (degree + 1) ** 2] = True
    assert torch.all(grad_wigner[~structural] == 0)


@fused_only
def test_unread_wigner_entries_do_not_matter() -> None:
    ops = make_operands(Case(2, 2, 32, 1, extra_dw=4))
    noisy = ops.wigner.clone()
    dim = n_coeff(2)
    noisy[:, dim:, :] = float("nan")  # outside the leading block
    noisy[:, :dim, dim:] = float("nan")
    noisy[:, 0, 1:dim] = 1e6  # off-block entries inside the leading block
    noisy[:, 4, 0:4] = -1e6  # row of degree 2 (m=-2), never read
    assert torch.equal(rotate_mix(*replace(ops, wigner=noisy).args()), rotate_mix(*ops.args()))


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("tiles", [LaunchTiles(1, 4), LaunchTiles(2, 4), LaunchTiles(4, 2)])
@pytest.mark.parametrize("rank", [0, 2])
def test_launch_tiles_per_edge_and_edge_block(tiles: LaunchTiles, rank: int) -> None:
    ops = make_operands(Case(2, 2, 32, rank, n_node=6, n_edge=11))
    ref = ops.cast(torch.float64)
    u = launch_rotate_mix_fwd(ops.x, ops.src, ops.wigner, ops.kc, ops.cb, 2, 2, rank, tiles)
    assert_close_normwise(u, rotate_mix_reference(*ref.args()))
    grad_u = torch.randn(u.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    got = launch_rotate_mix_bwd(grad_u, ops.x, ops.src, ops.src_order, ops.src_rowptr, ops.wigner,
                                ops.kc, ops.cb, 2, 2, rank, True, tiles)  # fmt: skip
    want = rotate_mix_backward_reference(grad_u.double(), *ref.args())
    for g, w in zip(got, want, strict=True):
        assert_close_normwise(g, w, rel=5e-6)


@pytest.mark.parametrize("case", [Case(2, 2, 8, 0), Case(2, 2, 8, 2), Case(3, 1, 4, 1)], ids=str)
def test_closed_form_backward_reference_matches_autograd(case: Case) -> None:
    ref = make_operands(case, device="cpu").cast(torch.float64)
    for t in ref.floats():
        t.requires_grad_(True)
    u = rotate_mix_reference(*ref.args())
    grad_u = torch.randn(u.shape, dtype=torch.float64)
    auto = torch.autograd.grad(u, ref.floats() if case.rank else ref.floats()[:3], grad_u)
    closed = rotate_mix_backward_reference(grad_u, *ref.args())
    for a, c in zip(auto, closed, strict=False):
        torch.testing.assert_close(c, a)


def _second_order(ops: Operands, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A force-loss-like chain: g = ∂E/∂(operands) with create_graph, then ∂(Σ wᵢ·gᵢ²)/∂(…)."""
    leaves = ops.floats() if ops.rank else ops.floats()[:3]
    for t in leaves:
        t.requires_grad_(True)
    fn = rotate_mix if ops.x.dtype == torch.float32 else rotate_mix_reference
    u = fn(*ops.args())
    energy = (u * u * weights[0]).sum()  # nonlinear in u: grad_u depends on the operands
    grads = torch.autograd.grad(energy, leaves, create_graph=True)
    loss = sum(((g * w) ** 2).sum() for g, w in zip(grads, weights[1:], strict=False))
    return [*grads, *torch.autograd.grad(loss, leaves)]


def _assert_second_order_matches(case: Case) -> tuple[Operands, tuple[int, int, int]]:
    """Fused second order vs the float64 reference; returns the operands and grad_u's shape."""
    ops = make_operands(case, seed=7)
    gen = torch.Generator().manual_seed(8)
    u_shape = (case.n_focus, case.n_edge, (3 * case.lmax + 1) * case.focus_dim)
    shapes = [u_shape] + [tuple(t.shape) for t in ops.floats()]
    weights64 = [torch.rand(s, generator=gen, dtype=torch.float64).to(DEVICE) for s in shapes]
    fused = _second_order(ops, [w.float() for w in weights64])
    reference = _second_order(ops.cast(torch.float64), weights64)
    for got, want in zip(fused, reference, strict=True):
        assert_close_normwise(got, want, rel=2e-5)
    return ops, u_shape


@fused_only
@pytest.mark.parametrize(
    "case",
    [Case(1, 2, 32, 0), Case(2, 1, 32, 1, extra_dw=3), Case(2, 2, 32, 2),
     Case(3, 3, 64, 3, extra_dw=2), Case(4, 1, 96, 4, n_node=2, n_edge=1),
     Case(5, 1, 128, 0, n_node=3, n_edge=4), Case(2, 1, 32, 1, n_node=3, n_edge=0)],
    ids=str,
)  # fmt: skip
def test_second_order_matches_reference(poisoned_alloc: None, case: Case) -> None:
    _assert_second_order_matches(case)


@fused_only
def test_backward_is_deterministic() -> None:
    ops = make_operands(Case(2, 2, 32, 1, n_node=4, n_edge=40))
    grad_u = torch.randn(2, 40, 7 * 32).to(DEVICE)
    first = rotate_mix_backward(grad_u, *ops.args())
    second = rotate_mix_backward(grad_u, *ops.args())
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("rank", [0, 1])
def test_zero_edges(rank: int) -> None:
    ops = make_operands(Case(2, 1, 32, rank, n_node=3, n_edge=0))
    for t in ops.floats():
        t.requires_grad_(True)
    u = rotate_mix(*ops.args())
    assert u.shape == (1, 0, 7 * 32)
    grads = torch.autograd.grad(u.sum(), ops.floats()[:3], allow_unused=True)
    assert torch.equal(grads[0], torch.zeros_like(ops.x))
    assert grads[1].shape == ops.wigner.shape and grads[2].shape == ops.kc.shape


@fused_only
@pytest.mark.parametrize("rank", [0, 2])
def test_opcheck(rank: int) -> None:
    ops = make_operands(Case(2, 2, 32, rank, n_node=3, n_edge=5))
    for t in ops.floats():
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.so2kernels.so2_rotate_mix.default, ops.args())
    grad_u = torch.randn(2, 5, 7 * 32, device=DEVICE)
    torch.library.opcheck(
        torch.ops.so2kernels.so2_rotate_mix_bwd.default, (grad_u, *ops.args(), True)
    )


@fused_only
def test_torch_compile_aot_eager() -> None:
    ops = make_operands(Case(2, 2, 32, 1, n_node=4, n_edge=9))
    for t in ops.floats():
        t.requires_grad_(True)

    def energy(x: torch.Tensor, wigner: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
        u = rotate_mix(x, ops.src, ops.src_order, ops.src_rowptr, wigner, kc, ops.cb, 2, 2, 1)
        return (u * u).sum()

    compiled = torch.compile(energy, backend="aot_eager", fullgraph=True)
    inputs = (ops.x, ops.wigner, ops.kc)
    want = torch.autograd.grad(energy(*inputs), inputs)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_golden_slot_orientation() -> None:
    """deepmd's rank-1 degree mixer on the triclinic cell: kc = rad[m0 rows] @ W_mix."""
    path = shared_path("reference", "golden", "tiny_fused_common_intermediates.npz")
    ckpt = torch.load(shared_path("reference", "golden", "tiny_fused_plain.pt"), weights_only=True)
    prefix = "model.Default.atomic_model.descriptor.blocks.0.so2_conv.radial_degree_mixer."
    w_mix = ckpt["model"][prefix + "weight"].double()
    basis = ckpt["model"][prefix + "channel_basis"].double()
    data = np.load(path)
    x_rot = torch.from_numpy(data["tricl_b0_x_local_rot"]).double()
    rad = torch.from_numpy(data["tricl_b0_rad_wide"]).double()
    want = torch.from_numpy(data["tricl_b0_mixer_out"]).double()
    kc = rad[:, :3].reshape(3, -1) @ w_mix
    got = mix_degrees_reference(x_rot, kc, basis, lmax=2, rank=1)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    if use_triton(torch.empty(1, device=DEVICE)):
        # The fused kernel with identity rotations and x = the rotated rows put back in place.
        x = torch.zeros(3, 9, 128, dtype=torch.float64)
        x[:, list(reduced_to_packed(2))] = x_rot
        src = torch.arange(3)
        order, row_ptr = csr_from_index(src, 3)
        eye = torch.eye(9).expand(3, 9, 9).contiguous()
        u = rotate_mix(x.float().to(DEVICE), src.to(DEVICE), order.to(DEVICE),
                       row_ptr.to(DEVICE), eye.to(DEVICE), kc.float().to(DEVICE),
                       basis.float().to(DEVICE), 2, 4, 1)  # fmt: skip
        fused = u.reshape(4, 3, 7, 32).permute(1, 2, 0, 3).reshape(3, 7, 128)
        assert (fused.double().cpu() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.gpu
def test_rank0_placeholder_basis_elsewhere_keeps_the_fused_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 ignores cb: an empty placeholder left on the CPU must not send the op (or its
    backward) on CUDA operands to the eager reference. (CUDA only: on the CPU a tensor on any
    other device changes the dispatch key itself.)"""
    ops = make_operands(Case(2, 2, 32, 0, n_node=6, n_edge=17), device="cuda")
    elsewhere = replace(ops, cb=torch.empty(0, 64))
    launched: list[str] = []
    modules = {"fwd": import_module("so2kernels.rotate_mix"),
               "bwd": import_module("so2kernels.rotate_mix_backward")}  # fmt: skip
    for direction, module in modules.items():
        real = getattr(module, f"launch_rotate_mix_{direction}")

        def counted(*args: Any, _real: Any = real, _direction: str = direction) -> Any:
            launched.append(_direction)
            return _real(*args)

        monkeypatch.setattr(module, f"launch_rotate_mix_{direction}", counted)
    u = rotate_mix(*elsewhere.args())
    grads = rotate_mix_backward(torch.ones_like(u), *elsewhere.args())
    assert launched == ["fwd", "bwd"]
    assert torch.equal(u, rotate_mix(*ops.args()))
    for got, want in zip(grads[:3], rotate_mix_backward(torch.ones_like(u), *ops.args())[:3],
                         strict=True):  # fmt: skip
        assert torch.equal(got, want)


def test_bad_inputs_raise_typed_errors() -> None:
    ops = make_operands(Case(2, 2, 32, 1), device="cpu")
    with pytest.raises(ValueError, match="kc"):
        rotate_mix_reference(*replace(ops, kc=ops.kc[:, :-1]).args())
    with pytest.raises(ValueError, match="wigner"):
        rotate_mix_reference(*replace(ops, wigner=ops.wigner[:, :4, :4]).args())
    with pytest.raises(ValueError, match="n_focus"):
        rotate_mix_reference(*replace(ops, n_focus=3).args())
    with pytest.raises(ValueError, match="src_rowptr"):
        rotate_mix_reference(*replace(ops, src_rowptr=ops.src_rowptr[:-1]).args())


@fused_only
def test_fused_path_refuses_other_dtypes_and_regimes() -> None:
    ops = make_operands(Case(2, 2, 32, 1))
    with pytest.raises(UnsupportedInputError, match="float32"):
        rotate_mix(*ops.cast(torch.float64).args())
    with pytest.raises(ValueError, match="focus_dim"):
        rotate_mix(*make_operands(Case(2, 2, 16, 1)).args())


# Edge-parallel backward variant (selected through the tile table's "variant")

EDGE_TILES = LaunchTiles(block_e=4, num_warps=4, variant="edge")

EDGE_CASES = [
    Case(1, 2, 32, 1, extra_dw=5),
    Case(2, 1, 96, 0, strided_x=True),  # Cf 96: 128 lanes, 32 masked; rank 0
    Case(2, 3, 32, 2, n_edge=14),  # E not a multiple of block_e
    Case(3, 1, 64, 1, extra_dw=7),
    Case(2, 2, 32, 2, n_edge=3, n_node=8),  # mostly nodes with no edges
    Case(2, 1, 32, 1, n_edge=0, n_node=3),  # zero edges: grad_x is exactly zero
]


@pytest.fixture
def edge_variant_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's backward takes the edge variant, as a table entry with variant "edge" makes it."""
    from so2kernels import rotate_mix_backward

    def edge_tiles(direction: str, *args: Any) -> LaunchTiles:
        assert direction == "bwd"
        return EDGE_TILES

    monkeypatch.setattr(rotate_mix_backward, "rotate_mix_tiles", edge_tiles)


@fused_only
@pytest.mark.usefixtures("edge_variant_selected")
@pytest.mark.parametrize(
    "case", [Case(1, 2, 32, 1, n_node=4, n_edge=9), Case(2, 1, 32, 0, n_node=4, n_edge=9)], ids=str
)
def test_edge_variant_second_order_and_determinism(case: Case) -> None:
    ops, u_shape = _assert_second_order_matches(case)
    grad_u = torch.randn(u_shape).to(DEVICE)
    first = rotate_mix_backward(grad_u, *ops.args())
    second = rotate_mix_backward(grad_u, *ops.args())
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


# CSR backward variant (the fallback; INTERPRETER_TILES runs it under the op as well)


def with_sources(ops: Operands, sources: Sequence[int]) -> Operands:
    """The operands with the edges' sources replaced and the source CSR rebuilt (the per-edge
    operands keep their shapes, so len(sources) must equal E)."""
    src = torch.tensor(sources, dtype=torch.int64, device=ops.x.device)
    assert src.shape[0] == ops.src.shape[0]
    order, row_ptr = csr_from_index(src, ops.x.shape[0])
    return replace(ops, src=src, src_order=order, src_rowptr=row_ptr)


CSR_LAYOUTS = {
    # Nodes 0, 2, 4 and 6 have no edges: before the first, between, and after the last segment.
    "gaps": [3, 1, 5, 3, 3, 1, 5, 3, 3, 1, 3, 3, 5],
    # One node owns every edge: its segment is cut by every chunk boundary.
    "one-node": [2] * 13,
    # Every segment one edge long, sources unsorted in edge order.
    "singletons": [6, 0, 5, 1, 4, 2, 3, 6, 0, 5, 1, 4, 2],
}


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("layout", CSR_LAYOUTS, ids=str)
@pytest.mark.parametrize(
    "tiles",
    [LaunchTiles(1, 1, "csr", chunk=1), LaunchTiles(1, 1, "csr", chunk=3),
     LaunchTiles(2, 1, "csr", chunk=5), LaunchTiles(4, 4, "csr")],
    ids=lambda t: f"b{t.block_e}-c{t.chunk}",
)  # fmt: skip
def test_csr_variant_segments_cut_across_programs(layout: str, tiles: LaunchTiles) -> None:
    """Segments cut by chunk boundaries anywhere (chunk 1: every edge its own program), nodes
    without edges anywhere, one node with every edge; every output written (poisoned)."""
    case = Case(2, 2, 32, 1, n_node=7, n_edge=13, extra_dw=3)
    ops = with_sources(make_operands(case, seed=3), CSR_LAYOUTS[layout])
    ref = ops.cast(torch.float64)
    grad_u = torch.randn(2, 13, 7 * 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = launch_rotate_mix_bwd(grad_u, ops.x, ops.src, ops.src_order, ops.src_rowptr, ops.wigner,
                                ops.kc, ops.cb, 2, 2, 1, True, tiles)  # fmt: skip
    want = rotate_mix_backward_reference(grad_u.double(), *ref.args())
    for g, w in zip(got, want, strict=True):
        assert_close_normwise(g, w, rel=5e-6)
    assert_structural_wigner_grad(got[1], case.lmax)
    isolated = ops.src_rowptr[1:] == ops.src_rowptr[:-1]
    assert torch.equal(got[0][isolated], torch.zeros_like(got[0][isolated]))


CSR_CASES = [
    Case(1, 1, 32, 0, n_edge=11),
    Case(2, 1, 96, 0, strided_x=True),  # Cf 96: 128 lanes, 32 masked; rank 0
    Case(3, 2, 64, 3, extra_dw=7),
    Case(3, 1, 32, 4, n_edge=7, n_node=3),
    Case(2, 1, 32, 1, n_edge=1, n_node=1),  # single edge, single node
    Case(2, 2, 32, 2, n_edge=3, n_node=8),  # mostly nodes with no edges
    Case(2, 1, 32, 1, n_edge=0, n_node=3),  # zero edges: grad_x is exactly zero
]


# The node schedule where the H200 table picks it (C_wide 128, lmax 3, rank 1; 4 edges per step
# as there) and at the regime's high end (lmax 5-6, ranks 3-4, Cf 96/128).
NODE_CASES = [
    (LaunchTiles(4, 8, "node"), Case(3, 1, 128, 1, n_edge=11)),
    (LaunchTiles(1, 4, "node"), Case(5, 2, 96, 3, n_edge=7, n_node=3)),
    (LaunchTiles(2, 4, "node"), Case(6, 1, 32, 4, n_edge=5, n_node=4, extra_dw=2)),
]

SCHEDULE_CASES = [
    *((EDGE_TILES, case) for case in [*EDGE_CASES, Case(4, 1, 128, 4, n_edge=6, n_node=3)]),
    *((LaunchTiles(1, 1, "csr", chunk=2), case) for case in CSR_CASES),
    *NODE_CASES,
]


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize(
    ("tiles", "case"), SCHEDULE_CASES, ids=[f"{t.variant}-{c}" for t, c in SCHEDULE_CASES]
)
def test_schedule_gradients_match_reference(tiles: LaunchTiles, case: Case) -> None:
    """Each non-default backward schedule, launched directly, against the float64 closed form."""
    ops = make_operands(case)
    ref = ops.cast(torch.float64)
    u_shape = (case.n_focus, case.n_edge, (3 * case.lmax + 1) * case.focus_dim)
    grad_u = torch.randn(u_shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = launch_rotate_mix_bwd(grad_u, ops.x, ops.src, ops.src_order, ops.src_rowptr, ops.wigner,
                                ops.kc, ops.cb, case.lmax, case.n_focus, case.rank, True,
                                tiles)  # fmt: skip
    if case.n_edge == 0:
        # Everything per edge is empty; node and basis gradients are exact zeros.
        assert torch.equal(got[0], torch.zeros_like(ops.x))
        assert torch.equal(got[3], torch.zeros_like(ops.cb))
        assert got[1].shape == ops.wigner.shape and got[2].shape == ops.kc.shape
        return
    want = rotate_mix_backward_reference(grad_u.double(), *ref.args())
    for g, w in zip(got, want, strict=True):
        assert_close_normwise(g, w, rel=5e-6)
    assert_structural_wigner_grad(got[1], case.lmax)


@fused_only
def test_csr_variant_is_deterministic_and_agrees_with_node_variant() -> None:
    """Run to run bitwise; against the node variant (another summation order) to rounding."""
    ops = with_sources(make_operands(Case(2, 2, 32, 2, n_node=7, n_edge=13)), CSR_LAYOUTS["gaps"])
    grad_u = torch.randn(2, 13, 7 * 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = (grad_u, ops.x, ops.src, ops.src_order, ops.src_rowptr, ops.wigner, ops.kc, ops.cb,
            2, 2, 2, True)  # fmt: skip
    csr = LaunchTiles(1, 1, "csr", chunk=3)
    first = launch_rotate_mix_bwd(*args, csr)
    second = launch_rotate_mix_bwd(*args, csr)
    node = launch_rotate_mix_bwd(*args, LaunchTiles(1, 4, "node"))
    for a, b, c in zip(first, second, node, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_csr_chunk_follows_edge_count() -> None:
    from so2kernels.tiles import CSR_CHUNK_BOUNDS, csr_chunk

    low, high = CSR_CHUNK_BOUNDS
    one_warp = LaunchTiles(1, 1, "csr")
    assert csr_chunk(0, one_warp) == low
    assert csr_chunk(17_064, one_warp) == low  # the 192-atom graph: ~1000 programs
    assert csr_chunk(1_051_392, one_warp) == 128  # the bar: ~8200 programs
    assert csr_chunk(10**9, one_warp) == high
    assert csr_chunk(100, LaunchTiles(32, 1, "csr")) == 32  # at least one edge block
    assert csr_chunk(10**6, LaunchTiles(1, 1, "csr", chunk=24)) == 24  # explicit


def test_shipped_tile_tables_hold_valid_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry of every shipped rotate-mix table reads as a launch (a bad entry would fail
    only on that GPU, at its first request of that shape)."""
    from so2kernels import tiles

    # The folder also holds the mixing-stack tables and the recorded kernel sets.
    others = ("mixing_stack_", ".kernels.")
    shipped = sorted(
        p for p in tiles.TABLES_DIR.glob("*.json") if not any(tag in p.name for tag in others)
    )
    assert shipped, "no rotate-mix table ships"
    for path in shipped:
        table = tiles.load_table(path.stem)
        name = str(table["device"])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        for direction in ("fwd", "bwd"):
            for key in table.get(f"rotate_mix_{direction}", {}):
                c_wide, lmax, rank = (int(v) for v in re.findall(r"\d+", key))
                launch = tiles.rotate_mix_tiles(direction, c_wide, lmax, rank, torch.device("cuda"))
                assert launch.block_e == table[f"rotate_mix_{direction}"][key]["block_e"]


def test_tile_table_selects_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    from so2kernels import tiles

    table = {
        "rotate_mix_bwd": {
            "cw128_l2_r1": {"variant": "edge", "block_e": 2, "num_warps": 8, "ms": 1.0},
            "cw128_l3_r1": {"block_e": 4, "num_warps": 8},  # written before variants existed
            "cw128_l2_r2": {"variant": "csr", "block_e": 1, "num_warps": 1, "chunk": 32},
        }
    }
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(tiles, "load_table", lambda slug: table)
    cuda = torch.device("cuda")
    assert tiles.rotate_mix_tiles("bwd", 128, 2, 1, cuda) == LaunchTiles(2, 8, "edge")
    assert tiles.rotate_mix_tiles("bwd", 128, 3, 1, cuda) == LaunchTiles(4, 8, "node")
    assert tiles.rotate_mix_tiles("bwd", 128, 2, 2, cuda) == LaunchTiles(1, 1, "csr", chunk=32)
    assert tiles.rotate_mix_tiles("bwd", 256, 2, 1, cuda) == tiles.fallback_tiles("bwd", 256, 2)
    # The fallback is the csr schedule, one warp per program where its registers allow.
    assert tiles.fallback_tiles("bwd", 128, 2) == LaunchTiles(1, 1, "csr")
    assert tiles.fallback_tiles("bwd", 128, 3) == LaunchTiles(1, 1, "csr")
    assert tiles.fallback_tiles("bwd", 256, 3).num_warps > 1
    with pytest.raises(ValueError, match="variant"):
        LaunchTiles(1, 4, "warp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk"):
        LaunchTiles(1, 1, "csr", chunk=-1)


def _sm90_compile(fn: Any, pointers: dict[str, str], scalars: list[str],
                  constexprs: dict[str, Any], num_warps: int) -> Any:  # fmt: skip
    """Compile one kernel for sm_90 with the runtime's divisibility-by-16 specialisation of its
    pointers (so vectorised loads and register use match a real launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {f"{p}_ptr": dtype for p, dtype in pointers.items()}
    signature.update(dict.fromkeys(scalars, "i64"))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    aligned = {(fn.arg_names.index(f"{p}_ptr"),): [["tt.divisibility", 16]] for p in pointers}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )


def compile_backward_kernels_for_sm90() -> int:
    """Compile every backward schedule for sm_90 at the bar shape (C_wide 128, lmax 2, rank 1)
    without a GPU: catches lowering errors the interpreter cannot see. The one-warp csr kernel
    must keep its channel reductions inside the warp (no barrier). Returns the count."""
    from so2kernels import rotate_mix_backward as bwd

    def pointers(names: str) -> dict[str, str]:
        return {n: "*i64" if n in ("src", "order", "rowptr") else "*fp32" for n in names.split()}

    consts = {"L": 2, "FD": 128, "WD": 128, "WP": 128, "RANK": 1, "WANT_CB": True, "W_SR": 9,
              "GW_SR": 9}  # fmt: skip
    per_edge = ["n_edge", "x_sn", "w_se"]
    kernels = [
        (bwd._rotate_mix_bwd_kernel, pointers("gu x w kc cb order rowptr gx gw gkc gcb"),
         per_edge, {**consts, "BLOCK_E": 1}, 4),
        (bwd._rotate_mix_bwd_edge_kernel, pointers("gu x src w kc cb gxe gw gkc gcb"),
         per_edge, {**consts, "BLOCK_E": 4}, 4),
        (bwd._rotate_mix_bwd_csr_kernel,
         pointers("gu x src w kc cb order rowptr gx part gw gkc gcb"),
         ["n_edge", "chunk", "x_sn", "w_se"], {**consts, "BLOCK_E": 1}, 1),
        (bwd._finish_split_nodes_kernel, pointers("gx part rowptr"), ["chunk"],
         {"DIM": 9, "DP": 16, "WD": 128, "WP": 128}, 4),
    ]  # fmt: skip
    for fn, ptrs, scalars, constexprs, num_warps in kernels:
        compiled = _sm90_compile(fn, ptrs, scalars, constexprs, num_warps)
        assert compiled.asm["cubin"]
        if fn is bwd._rotate_mix_bwd_csr_kernel:
            assert "bar.sync" not in compiled.asm["ptx"], "csr reductions left the warp"
    return len(kernels)


@pytest.mark.slow
def test_backward_kernels_compile_for_sm90() -> None:
    assert compiled_count("test_rotate_mix", "compile_backward_kernels_for_sm90()") == 4


# GPU: realistic sizes (run by the lead on the H200)


@pytest.mark.gpu
def test_gpu_rank0_basis_placeholder_on_the_host() -> None:
    """Rank 0 never reads ``cb``: a placeholder left on the host is accepted, and the fake puts
    its (empty) gradient beside ``x``, as the op does."""
    ops = make_operands(Case(2, 2, 32, 0, n_node=3, n_edge=5), device="cuda")
    args = (*ops.args()[:6], ops.cb.cpu(), *ops.args()[7:])
    grad_u = torch.randn(2, 5, 7 * 32, device="cuda")
    grads = torch.ops.so2kernels.so2_rotate_mix_bwd(grad_u, *args, True)
    assert grads[3].device == ops.x.device
    torch.library.opcheck(
        torch.ops.so2kernels.so2_rotate_mix_bwd.default, (grad_u, *args, True),
        test_utils=("test_faketensor",),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [Case(2, 1, 128, 1, n_node=4000, n_edge=200_000), Case(3, 2, 64, 2, n_node=4000,
                                                             n_edge=200_000),
     Case(2, 2, 96, 0, n_node=3000, n_edge=150_000, extra_dw=16)],
    ids=str,
)  # fmt: skip
def test_gpu_realistic_size(case: Case) -> None:
    ops = make_operands(case, device="cuda")
    ref = ops.cast(torch.float64)
    for t in ops.floats() + ref.floats():
        t.requires_grad_(True)
    u = rotate_mix(*ops.args())
    u_ref = rotate_mix_reference(*ref.args())
    assert_close_normwise(u, u_ref)
    grad_u = torch.randn(u.shape, device="cuda", dtype=torch.float64)
    n_leaves = 4 if case.rank else 3
    grads = torch.autograd.grad(u, ops.floats()[:n_leaves], grad_u.float())
    grads_ref = torch.autograd.grad(u_ref, ref.floats()[:n_leaves], grad_u)
    for got, want in zip(grads, grads_ref, strict=True):
        assert_close_normwise(got, want, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_int64_offsets() -> None:
    """E·ROW > 2^31 per focus plane, two planes: per-edge outputs of the last edges (of both
    focus streams) against the reference on those edges."""
    case = Case(2, 2, 128, 1, n_node=25_000, n_edge=2_500_000)
    ops = make_operands(case, device="cuda")
    assert case.n_edge * 7 * 128 > 2**31
    u = rotate_mix(*ops.args())
    tail = torch.arange(case.n_edge - 2000, case.n_edge, device="cuda")
    sub_order, sub_rowptr = csr_from_index(ops.src[tail], case.n_node)
    sub = replace(ops, src=ops.src[tail], src_order=sub_order, src_rowptr=sub_rowptr,
                  wigner=ops.wigner[tail], kc=ops.kc[tail]).cast(torch.float64)  # fmt: skip
    assert_close_normwise(u[:, tail], rotate_mix_reference(*sub.args()))
    grad_u = torch.zeros_like(u)
    grad_u[:, tail] = torch.randn(case.n_focus, 2000, 7 * 128, device="cuda")
    g_x, g_wigner, g_kc, _ = rotate_mix_backward(grad_u, *ops.args())
    w_x, w_wigner, w_kc, _ = rotate_mix_backward_reference(grad_u[:, tail].double(), *sub.args())
    # Only the tail's edges carry a cotangent, so the sub-problem's node gradient is the whole one.
    assert_close_normwise(g_x, w_x, rel=5e-6)
    assert_close_normwise(g_wigner[tail], w_wigner, rel=5e-6)
    assert_close_normwise(g_kc[tail], w_kc, rel=5e-6)
