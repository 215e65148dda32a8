"""so2kernels.so2_attention_aggregate: fused op vs eager reference (values, gradients, regimes)."""

from __future__ import annotations

import pytest
import torch
from test_gated_act import assert_normwise_close

from so2kernels._dispatch import UnsupportedInputError
from so2kernels.aggregate import (
    BwdTiles,
    attention_aggregate,
    attention_aggregate_backward_reference,
    attention_aggregate_reference,
    launch_aggregate_bwd,
    launch_aggregate_fwd,
    segment_parts,
)
from tests.offline_compile import compiled_count

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_operands(
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_groups: int,
    counts: list[int],
    wigner_dim: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Operands:
    """``(x_local (E, F, ROW), wigner (E, Dw, Dw), weights (E, G), dst_rowptr (N+1,))``.

    ``counts[i]`` edges end at node i (zeros give nodes without edges). The Wigner operand is
    random, not orthogonal: every entry the op must ignore is non-zero.
    """
    gen = torch.Generator().manual_seed(seed)
    n_edge = sum(counts)
    dim = wigner_dim or (lmax + 1) ** 2
    x_local = torch.randn(n_edge, n_focus, (3 * lmax + 1) * focus_dim, generator=gen)
    wigner = torch.randn(n_edge, dim, dim, generator=gen)
    weights = torch.rand(n_edge, n_groups, generator=gen)
    rowptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return tuple(t.to(device) for t in (x_local, wigner, weights, rowptr))  # type: ignore[return-value]


# (lmax, focus_dim, n_focus, n_groups, counts, wigner_dim): attention heads (G = F·H), the
# scatter mode (G = 1), padded widths (Cf 96), a wider Wigner cache, empty segments.
CASES = [
    (1, 32, 1, 1, [3, 0, 5], None),
    (2, 32, 2, 4, [5, 0, 7, 1, 17, 0], 16),
    (2, 96, 1, 2, [2, 9, 4], None),
    (3, 64, 2, 2, [0, 6, 1, 3], None),
    (2, 128, 1, 1, [33, 4], 25),
    (6, 32, 1, 1, [2, 3], None),
    # 29 destinations (empty ones included) over 37 edges: the backward's edge tile straddles
    # them all and is partial (E is not a multiple of BLOCK_E); see also the explicit tiles of
    # test_backward_tiles_straddle_destinations.
    (
        2,
        32,
        1,
        2,
        [1, 2, 0, 1, 1, 3, 1, 0, 2, 1, 1, 1, 4, 1, 2, 1, 1, 1, 0, 1, 2, 1, 1, 1, 3, 1, 1, 2, 1],
        None,
    ),
]


def _leaves(ops: Operands, dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().to(dtype).requires_grad_() for t in ops[:3]]


@pytest.mark.parametrize(("lmax", "focus_dim", "n_focus", "n_groups", "counts", "dw"), CASES)
def test_values_and_gradients(
    poisoned_alloc: None,
    lmax: int,
    focus_dim: int,
    n_focus: int,
    n_groups: int,
    counts: list[int],
    dw: int | None,
) -> None:
    ops = make_operands(lmax, focus_dim, n_focus, n_groups, counts, dw)
    rowptr = ops[3]
    fused_in = _leaves(ops, torch.float32)
    out = attention_aggregate(*fused_in, rowptr, lmax)
    ref_in = _leaves(ops, torch.float64)
    ref = attention_aggregate_reference(*ref_in, rowptr, lmax)
    assert_normwise_close(out, ref, 1e-6)
    empty_nodes = torch.tensor(counts) == 0
    assert bool((out[empty_nodes] == 0).all())
    grad_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, fused_in, grad_out.float())
    want = torch.autograd.grad(ref, ref_in, grad_out)
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)
    # Entries the op must not read get exactly zero gradient.
    assert bool((got[1][want[1] == 0] == 0).all())


def test_backward_closed_form_matches_autograd() -> None:
    lmax = 2
    ops = make_operands(lmax, 32, 2, 4, [4, 0, 6], 16)
    leaves = _leaves(ops, torch.float64)
    out = attention_aggregate_reference(*leaves, ops[3], lmax)
    grad_out = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, grad_out)
    got = attention_aggregate_backward_reference(grad_out, *leaves, ops[3], lmax)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


STRADDLING_COUNTS = [3, 1, 0, 0, 2, 1, 5, 0, 1, 1, 2, 1, 7, 1, 0, 1, 1, 4, 2, 1]


@pytest.mark.parametrize("block_e", [4, 32])
def test_backward_tiles_straddle_destinations(
    poisoned_alloc: None,
    block_e: int,
) -> None:
    """The edge-parallel backward at several tile heights against the float64 closed form:
    35 edges in tiles of 4 (8 full, one partial) or 32 (one full, one partial)."""
    lmax = 3
    ops = make_operands(lmax, 32, 2, 4, STRADDLING_COUNTS, 25, seed=7)
    rowptr = ops[3]
    grad_out = torch.randn(
        len(STRADDLING_COUNTS), 16, 64, generator=torch.Generator().manual_seed(8)
    )
    got = launch_aggregate_bwd(grad_out, *ops[:3], rowptr, lmax, tiles=BwdTiles(block_e, 4, 3))
    want = attention_aggregate_backward_reference(
        grad_out.double(), *(t.double() for t in ops[:3]), rowptr, lmax
    )
    for g, w in zip(got, want, strict=True):
        assert_normwise_close(g, w, 2e-6)
    assert bool((got[1][want[1] == 0] == 0).all())


SPLIT_COUNTS = [11, 0, 1, 2, 30, 5, 3, 0, 9]


@pytest.mark.parametrize(("n_part", "block_e"), [(1, 1), (2, 4), (3, 1), (7, 128)])
def test_forward_segment_parts(
    poisoned_alloc: None,
    n_part: int,
    block_e: int,
) -> None:
    """The forward's launch shapes against float64: the GPU's one edge per step, parts longer
    than an edge block, segments cut in ``n_part`` parts (partials summed), empty parts
    (segments shorter than ``n_part``) and empty segments."""
    lmax = 2
    ops = make_operands(lmax, 32, 2, 4, SPLIT_COUNTS, 16, seed=11)
    got = launch_aggregate_fwd(*ops, lmax, n_part=n_part, block_e=block_e)
    want = attention_aggregate_reference(*(t.double() for t in ops[:3]), ops[3], lmax)
    assert_normwise_close(got, want, 1e-6)
    assert bool((got[torch.tensor(SPLIT_COUNTS) == 0] == 0).all())
    assert torch.equal(got, launch_aggregate_fwd(*ops, lmax, n_part=n_part, block_e=block_e))


@pytest.mark.parametrize("lmax", [1, 3])
def test_forward_one_edge_per_step(lmax: int) -> None:
    """The GPU's edge step (one edge) at other degrees, with a wider Wigner cache."""
    ops = make_operands(lmax, 16, 1, 1, [3, 0, 5], (lmax + 2) ** 2, seed=12)
    got = launch_aggregate_fwd(*ops, lmax, n_part=2, block_e=1)
    want = attention_aggregate_reference(*(t.double() for t in ops[:3]), ops[3], lmax)
    assert_normwise_close(got, want, 1e-6)


def test_forward_parts_only_for_small_systems() -> None:
    """H200 (132 SMs), bar widths (one 128-channel block, ~89 edges per node): the 192-atom step
    cuts segments, 12,288 atoms keep the single-pass kernel; tiny segments are not cut."""
    assert segment_parts(192, 192 * 89, 1, 132) == 11
    assert segment_parts(12_288, 12_288 * 89, 1, 132) == 1
    assert segment_parts(192, 192 * 4, 1, 132) == 1
    assert segment_parts(0, 0, 1, 132) == 1
    assert segment_parts(4, 4 * 1000, 1, 132) == 32


def test_bad_part_count() -> None:
    ops = make_operands(2, 32, 1, 1, [3, 2])
    with pytest.raises(ValueError, match="n_part"):
        launch_aggregate_fwd(*ops, 2, n_part=0)


@pytest.mark.parametrize(
    ("lmax", "n_focus", "n_groups", "counts", "wigner_dim"),
    [(2, 1, 1, [3, 4], None), (3, 2, 4, [0, 5, 2], 20), (5, 1, 2, [1], None), (1, 1, 1, [], None)],
)
def test_second_order_through_op(
    poisoned_alloc: None,
    lmax: int,
    n_focus: int,
    n_groups: int,
    counts: list[int],
    wigner_dim: int | None,
) -> None:
    """Under ``create_graph`` the op's backward is differentiable (training's force loss)."""
    ops = make_operands(lmax, 32, n_focus, n_groups, counts, wigner_dim, seed=3)
    grad_out = torch.randn(len(counts), (lmax + 1) ** 2, 32 * n_focus, dtype=torch.float64)
    results = []
    for fn, dtype in (
        (attention_aggregate, torch.float32),
        (attention_aggregate_reference, torch.float64),
    ):
        leaves = _leaves(ops, dtype)
        out = fn(*leaves, ops[3], lmax)
        first = torch.autograd.grad(out, leaves, grad_out.to(dtype), create_graph=True)
        loss = sum((g * g).sum() for g in first)
        results.append(torch.autograd.grad(loss, leaves))
    for g, w in zip(*results, strict=True):
        assert_normwise_close(g, w, 1e-5)


def test_deterministic(poisoned_alloc: None) -> None:
    ops = make_operands(2, 32, 2, 2, [7, 1, 9])
    leaves = _leaves(ops, torch.float32)
    first = attention_aggregate(*leaves, ops[3], 2)
    grads = torch.autograd.grad(first, leaves, torch.ones_like(first))
    again = attention_aggregate(*leaves, ops[3], 2)
    grads_again = torch.autograd.grad(again, leaves, torch.ones_like(again))
    assert torch.equal(first, again)
    for a, b in zip(grads, grads_again, strict=True):
        assert torch.equal(a, b)


def test_edges_without_channels(poisoned_alloc: None) -> None:
    """Zero channels (ROW = 0) over real edges: every gradient is defined, the weights' zero."""
    ops = make_operands(2, 0, 1, 1, [3, 2])
    leaves = _leaves(ops, torch.float32)
    out = attention_aggregate(*leaves, ops[3], 2)
    assert out.shape == (2, 9, 0)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert torch.equal(grads[2], torch.zeros_like(ops[2]))


def test_zero_edges_and_zero_nodes() -> None:
    ops = make_operands(2, 32, 1, 1, [0, 0, 0])
    leaves = _leaves(ops, torch.float32)
    out = attention_aggregate(*leaves, ops[3], 2)
    assert out.shape == (3, 9, 32) and bool((out == 0).all())
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in leaves]
    none = make_operands(2, 32, 1, 1, [])
    assert attention_aggregate(*none[:3], none[3], 2).shape == (0, 9, 32)


def test_bad_inputs() -> None:
    x_local, wigner, weights, rowptr = make_operands(2, 32, 2, 4, [3, 2])
    with pytest.raises(UnsupportedInputError, match="float32"):
        attention_aggregate(x_local.double(), wigner.double(), weights.double(), rowptr, 2)
    with pytest.raises(ValueError, match="share one floating dtype"):
        attention_aggregate(x_local, wigner.double(), weights, rowptr, 2)
    with pytest.raises(ValueError, match="wigner must be"):
        attention_aggregate(x_local, wigner[:, :4, :4], weights, rowptr, 2)
    with pytest.raises(ValueError, match="do not divide"):
        attention_aggregate(x_local, wigner, weights[:, :3], rowptr, 2)
    with pytest.raises(ValueError, match="x_local must be"):
        attention_aggregate(x_local[:, :, 1:], wigner, weights, rowptr, 2)
    with pytest.raises(ValueError, match="dst_rowptr"):
        attention_aggregate(x_local, wigner, weights, rowptr.int(), 2)


def test_reference_runs_any_dtype() -> None:
    ops = make_operands(1, 32, 1, 1, [2, 3])
    half = [t.to(torch.bfloat16) for t in ops[:3]]
    out = attention_aggregate_reference(*half, ops[3], 1)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 32)


def test_opcheck() -> None:
    x_local, wigner, weights, rowptr = make_operands(2, 32, 2, 2, [3, 0, 4], 16)
    torch.library.opcheck(
        torch.ops.so2kernels.so2_attention_aggregate,
        (x_local.requires_grad_(), wigner.requires_grad_(), weights.requires_grad_(), rowptr, 2),
    )
    grad_out = torch.randn(3, 9, 64)
    torch.library.opcheck(
        torch.ops.so2kernels.so2_attention_aggregate_bwd,
        (grad_out, x_local.detach(), wigner.detach(), weights.detach(), rowptr, 2),
    )


def test_compile_aot_eager() -> None:
    ops = make_operands(1, 32, 1, 1, [2, 5])
    leaves = _leaves(ops, torch.float32)

    def energy(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return attention_aggregate(x, w, a, ops[3], 1).square().sum()

    compiled = torch.compile(energy, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(energy(*leaves), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


# Compilation for the H200 (sm_90) without a GPU: catches frontend/lowering errors that the
# interpreter cannot see.


def compile_all_for_sm90() -> int:
    """Compile both kernels for sm_90 in the regimes the model uses (the backward also at every
    tile shape the benchmark sweeps); returns the count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.kernels_aggregate import BWD_SWEEP_TILES
    from so2kernels import aggregate

    cuda = torch.device("cuda")
    regimes = [(2, 128, 1, 1), (2, 128, 2, 2), (3, 128, 2, 4), (6, 256, 2, 8), (1, 96, 1, 1)]
    n_compiled = 0
    for lmax, c_wide, n_focus, n_groups in regimes:
        focus_dim, dp = c_wide // n_focus, triton.next_power_of_2((lmax + 1) ** 2)
        lanes = triton.next_power_of_2(c_wide)
        shared = {"L": lmax, "FD": focus_dim, "WD": c_wide, "GW": c_wide // n_groups}
        kernels = [
            (
                aggregate._aggregate_fwd_kernel,
                ["x", "w", "wt", "rowptr", "scale", "out"],
                ["x_se", "w_se", "w_sr", "w_sc", "wt_se", "wt_sg"],
                {**shared, "DP": dp, "BLOCK_C": min(lanes, 128), "BLOCK_E": 1},
                aggregate._num_warps(dp, min(lanes, 128)),
            )
        ]
        bwd_tiles = {aggregate._bwd_tiles(cuda, lanes)}
        if (lmax, c_wide, n_focus, n_groups) == (2, 128, 1, 1):
            bwd_tiles.update(BWD_SWEEP_TILES)
        for block_e, warps, col_stages in sorted(bwd_tiles):
            kernels.append(
                (
                    aggregate._aggregate_bwd_kernel,
                    ["gout", "x", "w", "wt", "dst", "scale", "gx", "gw", "gwt"],
                    ["n_edge", "x_se", "w_se", "w_sr", "w_sc", "wt_se", "wt_sg", "gw_se",
                     "gw_sr", "gw_sc"],
                    {**shared, "G": n_groups, "WP": lanes, "BLOCK_E": block_e,
                     "RUN": aggregate._contiguous_run(focus_dim, lanes),
                     "SP": aggregate._structural_slots(lmax), "COL_STAGES": col_stages},
                    warps,
                )
            )  # fmt: skip
        for fn, pointers, scalars, consts, warps in kernels:
            signature = {
                f"{p}_ptr": "*i64" if p in ("rowptr", "dst") else "*fp32" for p in pointers
            }
            signature.update(dict.fromkeys(scalars, "i64"))
            signature.update(dict.fromkeys(consts, "constexpr"))
            # Aligned pointers and row strides, as the launcher's runtime specialisation sees
            # them: the vectorised layouts are the ones compiled.
            aligned = [n for n in signature if n.endswith("_ptr") or n == "x_se"]
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
            )
            assert compiled.asm["cubin"]
            n_compiled += 1
    return n_compiled


N_SM90_KERNELS = 15
"""5 forward regimes, 5 backward regimes at their default tiles, 5 more swept bar tiles."""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    assert compiled_count("test_aggregate", "compile_all_for_sm90()") == N_SM90_KERNELS


# GPU (the lead runs these on the H200)


def node_subgraph(rowptr: torch.Tensor, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edges, sub_rowptr)`` of some nodes with all their edges: the exact sub-problem for
    those nodes' outputs (shared with test_outer_sum)."""
    counts = rowptr[1:] - rowptr[:-1]
    edges = torch.cat([torch.arange(int(rowptr[n]), int(rowptr[n + 1])) for n in nodes.tolist()])
    sub_ptr = torch.zeros(len(nodes) + 1, dtype=torch.int64, device=rowptr.device)
    sub_ptr[1:] = torch.cumsum(counts[nodes.to(rowptr.device)], 0)
    return edges.to(rowptr.device), sub_ptr


def _node_sample(ops: Operands, nodes: torch.Tensor) -> tuple[Operands, torch.Tensor]:
    x_local, wigner, weights, rowptr = ops
    edges, sub_ptr = node_subgraph(rowptr, nodes)
    return (x_local[edges], wigner[edges], weights[edges], sub_ptr), edges


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_groups"), [(2, 128, 1, 1), (3, 64, 2, 4)]
)
def test_gpu_realistic_size(lmax: int, focus_dim: int, n_focus: int, n_groups: int) -> None:
    """E ≈ 1e6 (11k nodes × ~90 edges): values and gradients vs fp64 on sampled nodes."""
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(60, 121, (11_000,), generator=gen)
    counts[::997] = 0
    ops = make_operands(lmax, focus_dim, n_focus, n_groups, counts.tolist(), 16, device="cuda")
    leaves = _leaves(ops, torch.float32)
    out = attention_aggregate(*leaves, ops[3], lmax)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    for t in (out, *grads):
        assert bool(torch.isfinite(t).all())
    nodes = torch.cat([torch.arange(0, 8), torch.randint(0, 11_000, (64,)), torch.tensor([10_999])])
    sub, edges = _node_sample(ops, nodes)
    ref_in = _leaves(sub, torch.float64)
    ref = attention_aggregate_reference(*ref_in, sub[3], lmax)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out[nodes.cuda()].double())
    assert_normwise_close(out[nodes.cuda()], ref, 1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_normwise_close(got[edges], want, 2e-6)
    again = attention_aggregate(*leaves, ops[3], lmax)
    assert torch.equal(out, again), "the CSR reduction must be bitwise reproducible"


@pytest.mark.gpu
def test_gpu_small_system_cuts_segments() -> None:
    """192 nodes × ~89 edges (the 192-atom step): the default launch cuts every segment in
    parts; values vs float64 and bitwise repeatable."""
    gen = torch.Generator().manual_seed(6)
    counts = torch.randint(60, 121, (192,), generator=gen).tolist()
    ops = make_operands(2, 128, 1, 1, counts, 16, device="cuda")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert segment_parts(192, sum(counts), 1, n_sm) > 1
    out = launch_aggregate_fwd(*ops, 2)
    want = attention_aggregate_reference(*(t.double() for t in ops[:3]), ops[3], 2)
    assert_normwise_close(out, want, 1e-6)
    assert torch.equal(out, launch_aggregate_fwd(*ops, 2))


@pytest.mark.gpu
def test_gpu_backward_has_no_host_sync() -> None:
    """The backward derives dst(e) on the device: no host round trip once warm."""
    ops = make_operands(2, 128, 1, 1, [40, 0, 25, 3] * 50, device="cuda")
    leaves = _leaves(ops, torch.float32)
    out = attention_aggregate(*leaves, ops[3], 2)
    grad_out = torch.randn_like(out)
    torch.autograd.grad(out, leaves, grad_out, retain_graph=True)  # warm: compile, constants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(out, leaves, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("lmax", "focus_dim", "n_focus", "n_groups"), [(2, 128, 1, 1), (3, 64, 2, 4), (1, 96, 1, 1)]
)
def test_gpu_backward_launch_shapes(lmax: int, focus_dim: int, n_focus: int, n_groups: int) -> None:
    """Every launch shape the benchmark sweeps (pipelined column gathers run only on the GPU,
    the interpreter ignores them) against the float64 closed form."""
    from benchmarks.kernels_aggregate import BWD_SWEEP_TILES

    gen = torch.Generator().manual_seed(9)
    counts = torch.randint(0, 90, (300,), generator=gen).tolist()
    ops = make_operands(lmax, focus_dim, n_focus, n_groups, counts, 16, device="cuda")
    grad_out = torch.randn(len(counts), (lmax + 1) ** 2, n_focus * focus_dim, device="cuda")
    want = attention_aggregate_backward_reference(
        grad_out.double(), *(t.double() for t in ops[:3]), ops[3], lmax
    )
    for tiles in BWD_SWEEP_TILES:
        got = launch_aggregate_bwd(grad_out, *ops[:3], ops[3], lmax, tiles)
        for g, w in zip(got, want, strict=True):
            assert_normwise_close(g, w, 2e-6)
