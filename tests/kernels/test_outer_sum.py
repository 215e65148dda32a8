"""so2kernels.segment_outer_sum: fused op (interpreter on CPU) vs the eager reference: values,
first- and second-order gradients, launch shapes, strided operands, opcheck, torch.compile."""

from __future__ import annotations

import pytest
import torch
from test_aggregate import node_subgraph
from test_gated_act import assert_normwise_close

from so2kernels._dispatch import UnsupportedInputError, use_triton
from so2kernels._layout import INT32_SPAN, inner_offset_span, int32_inner_offsets
from so2kernels.outer_sum import (
    OuterSumTiles,
    default_bwd_tiles,
    default_tiles,
    launch_outer_sum_bwd,
    launch_outer_sum_fwd,
    segment_outer_sum,
    segment_outer_sum_backward_reference,
    segment_outer_sum_reference,
)
from tests.offline_compile import compiled_count

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

fused_only = pytest.mark.skipif(
    not use_triton(torch.empty(1)), reason="CPU operands take the fused path under the interpreter"
)


def degree_map(lmax: int) -> list[int]:
    """GIE's row map: the degree of every packed row l ≥ 1 (K = (L+1)²-1, J = L+1)."""
    return [l for l in range(1, lmax + 1) for _ in range(2 * l + 1)]


def make_operands(
    row_map: list[int],
    n_rows: int,
    n_chan: int,
    counts: list[int],
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Operands:
    """``(a (E, K), b (E, J, C), row_map (K,), dst_rowptr (N+1,))``; ``counts[n]`` edges end at
    node n (zeros give nodes without edges)."""
    gen = torch.Generator().manual_seed(seed)
    n_edge = sum(counts)
    a = torch.randn(n_edge, len(row_map), generator=gen)
    b = torch.randn(n_edge, n_rows, n_chan, generator=gen)
    rowptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    ops = (a, b, torch.tensor(row_map, dtype=torch.int64), rowptr)
    return tuple(t.to(device) for t in ops)  # type: ignore[return-value]


def _leaves(ops: Operands, dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().to(dtype).requires_grad_() for t in ops[:2]]


EDGE_COUNTS = [0, 3, 0, 0, 5, 1, 9, 0, 2, 0]  # 20 edges; empty nodes at start, middle and end

# (row_map, J, C, counts): GIE lmax 2 (K 8, J 3, row 0 unmapped) and lmax 3 (K 15, J 4), the
# env seed (K 4, J 1), an unsorted map with an unmapped middle row (K 3, J 3); channel widths
# below, at and across the 128-lane channel block; a single node; a partial last edge tile.
CASES = [
    (degree_map(2), 3, 128, EDGE_COUNTS),
    (degree_map(2), 3, 130, [7]),
    (degree_map(3), 4, 96, EDGE_COUNTS),
    ([0, 0, 0, 0], 1, 16, EDGE_COUNTS),
    ([0, 0, 0, 0], 1, 1, [2, 0, 3]),
    ([2, 0, 2], 3, 16, [37]),
    ([2, 0, 2], 3, 130, [4, 0, 1]),
]


@fused_only
@pytest.mark.parametrize(("row_map", "n_rows", "n_chan", "counts"), CASES)
def test_values_and_gradients(
    poisoned_alloc: None,
    row_map: list[int],
    n_rows: int,
    n_chan: int,
    counts: list[int],
) -> None:
    ops = make_operands(row_map, n_rows, n_chan, counts)
    fused_in = _leaves(ops, torch.float32)
    out = segment_outer_sum(*fused_in, *ops[2:])
    ref_in = _leaves(ops, torch.float64)
    ref = segment_outer_sum_reference(*ref_in, *ops[2:])
    assert_normwise_close(out, ref, 1e-6)
    assert bool((out[torch.tensor(counts) == 0] == 0).all())
    grad_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, fused_in, grad_out.float())
    want = torch.autograd.grad(ref, ref_in, grad_out)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)
    unmapped = [j for j in range(n_rows) if j not in row_map]
    assert bool((got[1][:, unmapped] == 0).all())


def test_backward_closed_form_matches_autograd() -> None:
    ops = make_operands([2, 0, 2, 1], 4, 5, [3, 0, 4])
    leaves = _leaves(ops, torch.float64)
    out = segment_outer_sum_reference(*leaves, *ops[2:])
    grad_out = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, grad_out)
    got = segment_outer_sum_backward_reference(grad_out, *leaves, *ops[2:])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@fused_only
@pytest.mark.parametrize("tiles", [OuterSumTiles(1, 16, 4), OuterSumTiles(4, 32, 4)])
def test_small_tiles_straddle_segments_and_channels(tiles: OuterSumTiles) -> None:
    """GPU-like narrow tiles: many edge steps per node (forward and backward), several channel
    blocks, partial last edge tiles."""
    ops = make_operands(degree_map(2), 3, 70, [*EDGE_COUNTS, 1, 2, 1], seed=3)
    grad_out = torch.randn(len(EDGE_COUNTS) + 3, 8, 70, dtype=torch.float64)
    ref = segment_outer_sum_reference(ops[0].double(), ops[1].double(), *ops[2:])
    want = segment_outer_sum_backward_reference(
        grad_out, ops[0].double(), ops[1].double(), *ops[2:]
    )
    assert_normwise_close(launch_outer_sum_fwd(*ops, tiles=tiles), ref, 1e-6)
    got = launch_outer_sum_bwd(grad_out.float(), *ops, tiles=tiles)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)


@fused_only
@pytest.mark.parametrize("n_part", [2, 5])
def test_backward_segment_parts(n_part: int) -> None:
    """The small-system backward (each node segment cut in ``n_part`` parts, one program each)
    against float64: parts longer than an edge tile, empty parts, empty segments, every edge
    written once."""
    counts = [*EDGE_COUNTS, 23, 1]
    ops = make_operands(degree_map(2), 3, 70, counts, seed=8)
    grad_out = torch.randn(len(counts), 8, 70, dtype=torch.float64)
    want = segment_outer_sum_backward_reference(
        grad_out, ops[0].double(), ops[1].double(), *ops[2:]
    )
    tiles = OuterSumTiles(4, 32, 4)
    got = launch_outer_sum_bwd(grad_out.float(), *ops, tiles=tiles, n_part=n_part)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)
    with pytest.raises(ValueError, match="n_part"):
        launch_outer_sum_bwd(grad_out.float(), *ops, n_part=0)


@fused_only
def test_strided_and_broadcast_operands() -> None:
    """``a`` transposed, ``b`` a broadcast view (the env seed's ``filt[:, None, :]`` and a
    stride-0 row axis): read in place, same result as contiguous copies."""
    gen = torch.Generator().manual_seed(4)
    rowptr = torch.tensor([0, 4, 4, 10])
    a = torch.randn(4, 10, generator=gen).t().requires_grad_()
    filt = torch.randn(10, 24, generator=gen).requires_grad_()
    row_map = torch.tensor([0, 0, 0, 0])
    b = filt[:, None, :].expand(10, 2, 24)
    out = segment_outer_sum(a, b, row_map, rowptr)
    ref = segment_outer_sum_reference(a.detach().double(), b.detach().double(), row_map, rowptr)
    assert_normwise_close(out, ref, 1e-6)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, filt), grad_out)
    leaves = (a.detach().double().requires_grad_(), filt.detach().double().requires_grad_())
    want_out = segment_outer_sum_reference(leaves[0], leaves[1][:, None, :], row_map, rowptr)
    want = torch.autograd.grad(want_out, leaves, grad_out.double())
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)


@fused_only
@pytest.mark.parametrize(("n_edge", "n_node"), [(0, 3), (0, 0)])
def test_without_edges_or_nodes(n_edge: int, n_node: int) -> None:
    a = torch.randn(n_edge, 8, requires_grad=True)
    b = torch.randn(n_edge, 3, 16, requires_grad=True)
    rowptr = torch.zeros(n_node + 1, dtype=torch.int64)
    out = segment_outer_sum(a, b, torch.tensor(degree_map(2)), rowptr)
    assert out.shape == (n_node, 8, 16)
    assert bool((out == 0).all())
    grads = torch.autograd.grad(out.sum(), (a, b))
    assert grads[0].shape == a.shape and grads[1].shape == b.shape


@fused_only
def test_deterministic() -> None:
    ops = make_operands(degree_map(2), 3, 32, [300, 0, 17], seed=5)
    first = segment_outer_sum(*ops)
    assert torch.equal(first, segment_outer_sum(*ops))


def _second_order(op: object, dtype: torch.dtype) -> list[torch.Tensor]:
    """Gradients of a force-loss-like scalar built from the first-order gradients."""
    ops = make_operands(degree_map(2), 3, 20, [3, 0, 5, 2], seed=6)
    a, b = _leaves(ops, dtype)
    weights = torch.randn(4, 8, 20, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = op(a, b, *ops[2:])  # type: ignore[operator]
    energy = (out**2 * weights).sum()
    grad_a, grad_b = torch.autograd.grad(energy, (a, b), create_graph=True)
    loss = (grad_a**2).sum() + (grad_b**2).sum()
    return [*torch.autograd.grad(loss, (a, b)), grad_a, grad_b]


@fused_only
def test_gradients_to_second_order_match_reference() -> None:
    fused = _second_order(segment_outer_sum, torch.float32)
    reference = _second_order(segment_outer_sum_reference, torch.float64)
    for got, want in zip(fused, reference, strict=True):
        assert_normwise_close(got, want, 1e-5)


@fused_only
def test_opcheck() -> None:
    ops = make_operands(degree_map(2), 3, 16, [3, 0, 4])
    a, b = _leaves(ops, torch.float32)
    torch.library.opcheck(torch.ops.so2kernels.segment_outer_sum.default, (a, b, *ops[2:]))
    grad_out = torch.randn(3, 8, 16)
    torch.library.opcheck(
        torch.ops.so2kernels.segment_outer_sum_bwd.default,
        (grad_out, a.detach(), b.detach(), *ops[2:]),
    )


@fused_only
def test_torch_compile_aot_eager() -> None:
    ops = make_operands(degree_map(2), 3, 16, [3, 0, 4])
    a, b = _leaves(ops, torch.float32)

    def energy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return segment_outer_sum(x, y, *ops[2:]).square().sum()

    compiled = torch.compile(energy, backend="aot_eager", fullgraph=True)
    want = torch.autograd.grad(energy(a, b), (a, b))
    got = torch.autograd.grad(compiled(a, b), (a, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@fused_only
def test_fused_path_refuses_non_float32() -> None:
    ops = make_operands(degree_map(1), 2, 4, [2, 1])
    with pytest.raises(UnsupportedInputError, match="float32 for 'a'"):
        segment_outer_sum(ops[0].double(), ops[1].double(), *ops[2:])


def test_bad_inputs_raise_value_errors() -> None:
    a, b, row_map, rowptr = make_operands(degree_map(1), 2, 4, [2, 1])
    with pytest.raises(ValueError, match=r"a must be \(E, K\)"):
        segment_outer_sum_reference(a[:, :, None], b, row_map, rowptr)
    with pytest.raises(ValueError, match=r"b must be \(E=3, J, C\)"):
        segment_outer_sum_reference(a, b[:2], row_map, rowptr)
    with pytest.raises(ValueError, match="row_map"):
        segment_outer_sum_reference(a, b, row_map[:2], rowptr)
    with pytest.raises(ValueError, match="row_map"):
        segment_outer_sum_reference(a, b, row_map.int(), rowptr)
    with pytest.raises(ValueError, match="dst_rowptr"):
        segment_outer_sum_reference(a, b, row_map, rowptr.float())
    with pytest.raises(ValueError, match="share one floating dtype"):
        segment_outer_sum_reference(a, b.double(), row_map, rowptr)
    with pytest.raises(ValueError, match="grad_out"):
        segment_outer_sum_backward_reference(torch.zeros(2, 3, 5), a, b, row_map, rowptr)


# Compilation for the H200 (sm_90) without a GPU: catches frontend/lowering errors that the
# interpreter cannot see.

SM90_REGIMES = [(8, 3, 128), (15, 4, 128), (4, 1, 64), (4, 1, 128), (3, 3, 130)]
"""(K, J, C): GIE lmax 2 and 3 at C 128, the env seed (K 4, J 1), a padded odd shape."""


def compile_all_for_sm90() -> int:
    """Compile both kernels for sm_90 at their default GPU tiles (the backward also at the
    narrow test tiles); returns the count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from so2kernels import outer_sum

    cuda = torch.device("cuda")
    index_pointers = ("map_ptr", "rowptr_ptr")
    n_compiled = 0
    launches = []
    for n_coeff, _, n_chan in SM90_REGIMES:
        fwd = (outer_sum._outer_sum_fwd_kernel, ("a", "b", "map", "rowptr", "out"))
        bwd = (outer_sum._outer_sum_bwd_kernel, ("g", "a", "b", "map", "rowptr", "ga", "gb"))
        launches.append((*fwd, n_coeff, n_chan, default_tiles(cuda, n_coeff, n_chan)))
        launches.append((*bwd, n_coeff, n_chan, default_bwd_tiles(cuda, n_chan)))
    launches.append((*bwd, 8, 70, OuterSumTiles(1, 16, 4)))
    for fn, pointers, n_coeff, n_chan, (block_e, block_c, warps) in launches:
        consts = {
            "K": n_coeff,
            "KP": triton.next_power_of_2(n_coeff),
            "BLOCK_E": block_e,
            "BLOCK_C": block_c,
        }
        signature = {f"{p}_ptr": "*fp32" for p in pointers}
        signature.update({p: "*i64" for p in signature if p in index_pointers})
        signature.update(dict.fromkeys(("a_se", "a_sk", "b_se", "b_sj", "J", "C"), "i64"))
        signature["b_sc"] = "constexpr"
        signature.update(dict.fromkeys(consts, "constexpr"))
        ordered = {name: signature[name] for name in fn.arg_names}
        # Aligned pointers, row strides and a unit channel stride, as the launcher's runtime
        # specialisation sees them in the model: the vectorised layouts are the ones compiled.
        aligned = [n for n in ordered if n.endswith("_ptr")]
        if n_chan % 16 == 0:
            aligned += ["b_se", "b_sj", "C"]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        source = ASTSource(fn=fn, signature=ordered, constexprs={**consts, "b_sc": 1}, attrs=attrs)
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
        )
        assert compiled.asm["cubin"]
        n_compiled += 1
    return n_compiled


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    assert compiled_count("test_outer_sum", "compile_all_for_sm90()") == 2 * len(SM90_REGIMES) + 1


# GPU (the lead runs these on the H200)


def _node_sample(ops: Operands, nodes: torch.Tensor) -> tuple[Operands, torch.Tensor]:
    a, b, row_map, rowptr = ops
    edges, sub_ptr = node_subgraph(rowptr, nodes)
    return (a[edges], b[edges], row_map, sub_ptr), edges


@pytest.mark.gpu
def test_gpu_realistic_size() -> None:
    """E ≈ 1e6 (11k nodes × ~90 edges), GIE lmax 2 at C 128: values and gradients vs float64
    on sampled nodes; bitwise repeatable."""
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(60, 121, (11_000,), generator=gen)
    counts[::997] = 0
    ops = make_operands(degree_map(2), 3, 128, counts.tolist(), device="cuda")
    leaves = _leaves(ops, torch.float32)
    out = segment_outer_sum(*leaves, *ops[2:])
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    for t in (out, *grads):
        assert bool(torch.isfinite(t).all())
    nodes = torch.cat([torch.arange(0, 8), torch.randint(0, 11_000, (64,)), torch.tensor([10_999])])
    sub, edges = _node_sample(ops, nodes)
    ref_in = _leaves(sub, torch.float64)
    ref = segment_outer_sum_reference(*ref_in, *sub[2:])
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out[nodes.cuda()].double())
    assert_normwise_close(out[nodes.cuda()], ref, 1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_normwise_close(got[edges], want, 2e-6)
    assert torch.equal(out, segment_outer_sum(*leaves, *ops[2:]))


@pytest.mark.gpu
def test_gpu_small_system_backward() -> None:
    """192 nodes × ~89 edges (the 192-atom step, segments cut in parts by default): backward vs
    float64, bitwise repeatable."""
    gen = torch.Generator().manual_seed(6)
    counts = torch.randint(60, 121, (192,), generator=gen).tolist()
    ops = make_operands(degree_map(2), 3, 128, counts, device="cuda")
    grad_out = torch.randn(192, 8, 128, device="cuda")
    got = launch_outer_sum_bwd(grad_out, *ops)
    want = segment_outer_sum_backward_reference(
        grad_out.double(), ops[0].double(), ops[1].double(), *ops[2:]
    )
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)
    again = launch_outer_sum_bwd(grad_out, *ops)
    assert all(torch.equal(g, h) for g, h in zip(got, again, strict=True))


@pytest.mark.gpu
def test_gpu_has_no_host_sync() -> None:
    """Forward and backward derive everything on the device: no host round trip once warm."""
    ops = make_operands(degree_map(2), 3, 128, [40, 0, 25, 3] * 50, device="cuda")
    leaves = _leaves(ops, torch.float32)
    grad_out = torch.randn(200, 8, 128, device="cuda")
    out = segment_outer_sum(*leaves, *ops[2:])
    torch.autograd.grad(out, leaves, grad_out)  # warm: compile, constants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = segment_outer_sum(*leaves, *ops[2:])
        torch.autograd.grad(out, leaves, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_inner_offsets_past_int32_are_copied_first() -> None:
    """The kernels form offsets inside an edge in int32: a layout whose inner span reaches 2³¹
    elements is handed over contiguous, any other as it is (decided on shapes and strides
    only; meta tensors hold no memory)."""
    huge = torch.empty(3, 9_000_000, 128, device="meta").permute(1, 0, 2)  # J-major (E, J, C)
    assert inner_offset_span(huge) >= INT32_SPAN
    assert int32_inner_offsets(huge).is_contiguous()
    small = torch.empty(3, 10_000, 128, device="meta").permute(1, 0, 2)
    assert int32_inner_offsets(small) is small
    assert inner_offset_span(torch.empty(0, 3, device="meta")) == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_j_major_rows_past_int32() -> None:
    """``b`` as a (E, J, C) view of a J-major buffer with j·E·C past 2³¹ (E 9M, 13.8 GB): the
    backward's ``grad_a`` of the last row must match (it wrapped around before the layout was
    copied)."""
    n_edge, per_node, n_rows, n_chan = 9_000_000, 100, 3, 128
    b = torch.randn(n_rows, n_edge, n_chan, device="cuda").permute(1, 0, 2)
    a = torch.randn(n_edge, n_rows, device="cuda")
    row_map = torch.arange(n_rows, device="cuda")
    rowptr = torch.arange(0, n_edge + 1, per_node, device="cuda")
    grad_out = torch.randn(n_edge // per_node, n_rows, n_chan, device="cuda")
    grad_a, _ = torch.ops.so2kernels.segment_outer_sum_bwd(grad_out, a, b, row_map, rowptr)
    tail = slice(n_edge - 2000, n_edge)
    dst = torch.arange(n_edge - 2000, n_edge, device="cuda") // per_node
    want = (grad_out[dst].double() * b[tail].double()).sum(2)
    assert_normwise_close(grad_a[tail], want, 1e-6)
