"""segment_sum / segment_broadcast: fused path (interpreter on CPU) against index_add_ and the
references, adjointness, autograd to second order, opcheck, torch.compile."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from so2kernels import segment as segment_module
from so2kernels._dispatch import INTERPRET, UnsupportedInputError, use_triton
from so2kernels.segment import (
    csr_from_index,
    segment_broadcast,
    segment_broadcast_reference,
    segment_of_position,
    segment_sum,
    segment_sum_reference,
    validate_csr,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
fused_only = pytest.mark.skipif(
    not use_triton(torch.empty(1, device=DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _graph(n_edge: int, n_node: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Leave the last node without edges when there is room for it.
    hi = max(n_node - 1, 1)
    index = torch.randint(0, hi, (n_edge,), generator=gen).to(DEVICE)
    order, row_ptr = csr_from_index(index, n_node)
    return index, order, row_ptr


SHAPES = [(), (3,), (4, 5), (2, 33)]


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
def test_poison_reaches_the_fused_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels skipped, both ops hand back NaN: the poison reaches their buffers."""
    monkeypatch.setattr(segment_module, "_run_csr_kernel", lambda *args: args[-1])
    _, order, row_ptr = _graph(5, 3, seed=0)
    rows = torch.ones(5, 2, device=DEVICE)
    assert bool(segment_sum(rows, order, row_ptr).isnan().all())
    assert bool(segment_broadcast(rows[:3], order, row_ptr).isnan().all())


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("trailing", SHAPES)
@pytest.mark.parametrize(("n_edge", "n_node"), [(37, 6), (1, 1), (1, 4), (0, 3), (9, 9)])
def test_segment_sum_matches_index_add(trailing: tuple[int, ...], n_edge: int, n_node: int) -> None:
    index, order, row_ptr = _graph(n_edge, n_node, seed=n_edge + n_node)
    rows = torch.randn(n_edge, *trailing, device=DEVICE)
    expected = torch.zeros(n_node, *trailing, device=DEVICE).index_add_(0, index, rows)
    torch.testing.assert_close(segment_sum(rows, order, row_ptr), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(segment_sum_reference(rows, order, row_ptr), expected)


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("trailing", SHAPES)
@pytest.mark.parametrize(("n_edge", "n_node"), [(37, 6), (1, 1), (0, 3)])
def test_segment_broadcast_is_a_gather(trailing: tuple[int, ...], n_edge: int, n_node: int) -> None:
    index, order, row_ptr = _graph(n_edge, n_node, seed=3)
    values = torch.randn(n_node, *trailing, device=DEVICE)
    assert torch.equal(segment_broadcast(values, order, row_ptr), values[index])
    assert torch.equal(segment_broadcast_reference(values, order, row_ptr), values[index])


@fused_only
def test_non_contiguous_rows_and_adjointness() -> None:
    _, order, row_ptr = _graph(50, 7, seed=5)
    rows = torch.randn(50, 8, 6, device=DEVICE)[:, ::2, 1:4]  # strided view
    values = torch.randn(7, 4, 3, device=DEVICE)
    lhs = (segment_sum(rows, order, row_ptr) * values).sum()
    rhs = (rows * segment_broadcast(values, order, row_ptr)).sum()
    torch.testing.assert_close(lhs, rhs, atol=1e-4, rtol=1e-5)


@fused_only
def test_deterministic() -> None:
    _, order, row_ptr = _graph(400, 5, seed=6)
    rows = torch.randn(400, 17, device=DEVICE)
    assert torch.equal(segment_sum(rows, order, row_ptr), segment_sum(rows, order, row_ptr))


def _second_order(
    op_sum: Callable[..., torch.Tensor], op_bcast: Callable[..., torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Gradients of a force-loss-like scalar through sum ∘ broadcast, to second order."""
    gen = torch.Generator().manual_seed(11)
    index = torch.randint(0, 5, (23,), generator=gen)
    order, row_ptr = (t.to(DEVICE) for t in csr_from_index(index, 6))
    rows, values, weights = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
        for shape in ((23, 3), (6, 3), (23, 3))
    )
    rows.requires_grad_(True)
    values.requires_grad_(True)
    energy = (op_sum(rows, order, row_ptr) ** 2 * values).sum() + (
        op_bcast(values, order, row_ptr) ** 2 * weights
    ).sum()
    g_rows, g_values = torch.autograd.grad(energy, (rows, values), create_graph=True)
    loss = (g_rows**2).sum() + (g_values**2).sum()
    return [*torch.autograd.grad(loss, (rows, values)), g_rows, g_values]


@fused_only
def test_gradients_to_second_order_match_reference() -> None:
    fused = _second_order(segment_sum, segment_broadcast, torch.float32)
    reference = _second_order(segment_sum_reference, segment_broadcast_reference, torch.float64)
    for got, want in zip(fused, reference, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@fused_only
def test_opcheck() -> None:
    _, order, row_ptr = _graph(19, 4, seed=8)
    rows = torch.randn(19, 2, 3, device=DEVICE, requires_grad=True)
    values = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.so2kernels.segment_sum.default, (rows, order, row_ptr))
    torch.library.opcheck(
        torch.ops.so2kernels.segment_broadcast.default, (values, order, row_ptr, 19)
    )
    grouped_rows = torch.randn(19, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.so2kernels.segment_sum.default, (grouped_rows, None, row_ptr))
    torch.library.opcheck(
        torch.ops.so2kernels.segment_broadcast.default, (values.double(), None, row_ptr, 19)
    )


@fused_only
def test_torch_compile_aot_eager() -> None:
    _, order, row_ptr = _graph(21, 5, seed=9)
    rows = torch.randn(21, 4, device=DEVICE, requires_grad=True)

    def roundtrip(r: torch.Tensor) -> torch.Tensor:
        return segment_broadcast(segment_sum(r, order, row_ptr), order, row_ptr).square().sum()

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    (want,) = torch.autograd.grad(roundtrip(rows), rows)
    (got,) = torch.autograd.grad(compiled(rows), rows)
    torch.testing.assert_close(got, want)


def test_bad_inputs_raise_typed_errors() -> None:
    index = torch.tensor([0, 2, 2])
    order, row_ptr = csr_from_index(index, 3)
    rows = torch.randn(3, 2)
    with pytest.raises(ValueError, match="int64"):
        segment_sum_reference(rows, order.int(), row_ptr)
    with pytest.raises(ValueError, match="entries"):
        segment_sum_reference(rows[:2], order, row_ptr)
    with pytest.raises(ValueError, match="segments"):
        segment_broadcast_reference(torch.randn(4, 2), order, row_ptr)
    validate_csr(order, row_ptr)
    with pytest.raises(ValueError, match="permutation"):
        validate_csr(torch.tensor([0, 0, 1]), row_ptr)
    with pytest.raises(ValueError, match="end at E"):
        validate_csr(order, torch.tensor([0, 1, 2, 2]))


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="fused path only")
def test_fused_path_refuses_non_float() -> None:
    order, row_ptr = csr_from_index(torch.tensor([1, 0]), 2)
    with pytest.raises(UnsupportedInputError, match="float64"):
        segment_sum(torch.ones(2, 3, dtype=torch.float16, device=DEVICE), order.to(DEVICE),
                    row_ptr.to(DEVICE))  # fmt: skip


def test_identity_order_needs_row_count() -> None:
    _, row_ptr = csr_from_index(torch.tensor([0, 1, 1]), 2)
    with pytest.raises(ValueError, match="n_rows"):
        segment_broadcast(torch.randn(2, 3), None, row_ptr)
    with pytest.raises(ValueError, match="n_rows=4"):
        segment_broadcast(torch.randn(2, 3), torch.arange(3), row_ptr, 4)


@fused_only
@pytest.mark.usefixtures("poisoned_alloc")
@pytest.mark.parametrize("trailing", [(), (3,), (3, 3)])
@pytest.mark.parametrize(("n_edge", "n_node"), [(300, 7), (1, 1), (0, 3), (2000, 2)])
def test_float64_grouped_sum_matches_float64_reference(
    trailing: tuple[int, ...], n_edge: int, n_node: int
) -> None:
    """The float64 assembly path: rows already grouped (order=None), float64 accumulation; long
    segments (1000 rows) take the wide position tile."""
    index, _, row_ptr = _graph(n_edge, n_node, seed=n_edge)
    rows = torch.randn(n_edge, *trailing, device=DEVICE, dtype=torch.float64) * 1e3
    rows = rows.index_select(0, torch.argsort(index, stable=True))
    expected = torch.zeros(n_node, *trailing, device=DEVICE, dtype=torch.float64)
    expected.index_add_(0, index.sort().values, rows)
    got = segment_sum(rows, None, row_ptr)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-13)
    assert torch.equal(got, segment_sum(rows, None, row_ptr))
    torch.testing.assert_close(segment_sum_reference(rows, None, row_ptr), expected)
    values = torch.randn(n_node, *trailing, device=DEVICE, dtype=torch.float64)
    gathered = values[index.sort().values]
    assert torch.equal(segment_broadcast(values, None, row_ptr, n_edge), gathered)
    assert torch.equal(segment_broadcast_reference(values, None, row_ptr, n_edge), gathered)


@fused_only
def test_float64_gradients_to_second_order_with_identity_order() -> None:
    def grouped_sum(r: torch.Tensor, order: torch.Tensor, row_ptr: torch.Tensor) -> torch.Tensor:
        return segment_sum(r.index_select(0, order), None, row_ptr)

    def grouped_bcast(v: torch.Tensor, order: torch.Tensor, row_ptr: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0]).to(order))
        return segment_broadcast(v, None, row_ptr, order.shape[0]).index_select(0, back)

    fused = _second_order(grouped_sum, grouped_bcast, torch.float64)
    reference = _second_order(segment_sum_reference, segment_broadcast_reference, torch.float64)
    for got, want in zip(fused, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
def test_gpu_realistic_size() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_node, n_edge = 20_000, 1_000_000
    index = torch.randint(0, n_node, (n_edge,), device="cuda", generator=gen)
    order, row_ptr = csr_from_index(index, n_node)
    rows = torch.randn(n_edge, 9, 128, device="cuda", generator=gen)
    expected = torch.zeros(n_node, 9, 128, device="cuda", dtype=torch.float64)
    expected.index_add_(0, index, rows.double())
    torch.testing.assert_close(segment_sum(rows, order, row_ptr).double(), expected,
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    values = torch.randn(n_node, 9, 128, device="cuda", generator=gen)
    assert torch.equal(segment_broadcast(values, order, row_ptr), values[index])


@pytest.mark.gpu
def test_gpu_float64_assembly_sizes() -> None:
    """The assembly's float64 sums at 12k-atom scale: per-atom over dst-sorted edges (grouped)
    and over the src CSR, then per-structure over 12k atoms in one segment; bitwise repeatable."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    n_node, n_edge = 12_288, 1_100_000
    index = torch.randint(0, n_node, (n_edge,), device="cuda", generator=gen).sort().values
    _, row_ptr = csr_from_index(index, n_node)
    rows = torch.randn(n_edge, 3, 3, device="cuda", generator=gen, dtype=torch.float64)
    expected = torch.zeros(n_node, 3, 3, device="cuda", dtype=torch.float64)
    expected.index_add_(0, index, rows)
    per_atom = segment_sum(rows, None, row_ptr)
    torch.testing.assert_close(per_atom, expected, atol=1e-10, rtol=1e-12)
    assert torch.equal(per_atom, segment_sum(rows, None, row_ptr))
    src_order = torch.randperm(n_edge, device="cuda", generator=gen)
    permuted = segment_sum(rows, src_order, row_ptr)
    torch.testing.assert_close(
        permuted, torch.zeros_like(expected).index_add_(0, index, rows[src_order]),
        atol=1e-10, rtol=1e-12,
    )  # fmt: skip
    one_structure = torch.tensor([0, n_node], device="cuda")
    total = segment_sum(per_atom, None, one_structure)
    torch.testing.assert_close(total[0], rows.sum(0), atol=1e-9, rtol=1e-12)


def test_segment_of_position() -> None:
    """Every CSR position's segment (an edge's destination), empty segments and none at all."""
    rowptr = torch.tensor([0, 2, 2, 3, 3, 6])
    assert segment_of_position(rowptr, 6).tolist() == [0, 0, 2, 4, 4, 4]
    assert segment_of_position(torch.zeros(4, dtype=torch.int64), 0).shape == (0,)
    assert segment_of_position(torch.zeros(1, dtype=torch.int64), 0).shape == (0,)
