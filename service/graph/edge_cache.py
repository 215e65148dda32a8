"""The edge cache: every per-edge geometric quantity the model needs, built once per evaluation.

Input is the edge-vector autograd leaf (float64, from :func:`service.graph.neighbors.edge_vectors`,
detached by the caller); everything here is computed in the compute dtype (fp32 by default, as
in the reference) and stays differentiable, so forces flow back to ``edge_vec`` through the
lengths, envelopes and the Wigner-D alike (model-dpa4.md §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from service.graph.neighbors import Graph
from service.graph.radial import c3_envelopes
from service.graph.segments import csr_segment_sum
from service.graph.wigner import edge_quaternion, wigner_d


@dataclass
class EdgeCache:
    """Per-edge geometry of one evaluation (E edges, N atoms, ``D = (lmax+1)²``).

    Attributes:
        vec: (E, 3) edge vectors in the compute dtype.
        length: (E,) ``sqrt(|r|² + eps²)``.
        env: (E,) ``E_p(r/rcut)`` with the message exponent (5): message weight.
        env_rbf: (E,) ``E_p(r/rcut)`` with the radial exponent (7): multiplies the radial basis
            (the model owns the trainable-frequency basis itself).
        quat: (E, 4) global→local quaternion (w, x, y, z), r̂ → +z.
        wigner: (E, D, D) block-diagonal real Wigner-D, contiguous.
        deg: (N,) ``Σ_{dst=i} env²``.
        inv_sqrt_deg: (N,) ``rsqrt(deg + deg_floor)``.
        graph: the topology (src/dst, CSRs, batch indices).
        rcut, lmax, eps: the parameters used.
    """

    vec: Tensor
    length: Tensor
    env: Tensor
    env_rbf: Tensor
    quat: Tensor
    wigner: Tensor
    deg: Tensor
    inv_sqrt_deg: Tensor
    graph: Graph
    rcut: float
    lmax: int
    eps: float


def regularised_length(vec: Tensor, eps: float) -> Tensor:
    """(E,) ``sqrt(|r|² + eps²)`` of (E, 3) vectors, never 0; its backward is the closed form
    ``g·r/length`` (two launches; autograd through the norm and hypot takes six), written in
    differentiable ops so force training's double backward works."""
    length: Tensor = _RegularisedLength.apply(vec, eps)  # type: ignore[no-untyped-call]
    return length


class _RegularisedLength(torch.autograd.Function):
    @staticmethod
    def forward(vec: Tensor, eps: float) -> Tensor:
        # Imported here: see the package docstring (service/graph/__init__.py).
        from so2kernels._layout import device_constant

        eps_row = device_constant((eps,), vec.device, vec.dtype)
        return torch.hypot(torch.linalg.vector_norm(vec, dim=-1), eps_row)

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, float], output: Tensor
    ) -> None:
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        vec, length = ctx.saved_tensors  # type: ignore[attr-defined]
        return vec * (grad / length)[:, None], None


def inverse_sqrt_degree(env: Tensor, dst_rowptr: Tensor, floor: float) -> tuple[Tensor, Tensor]:
    """``(deg, rsqrt(deg + floor))``, both (N,) in env's dtype, with ``deg_i = Σ_{dst=i} env²``
    summed in float64 (deterministic CSR). The backward is the closed form
    ``g_env = env·broadcast(2·g_deg − g_inv·inv³)`` (four launches; autograd through the casts,
    the sum and the rsqrt takes eight), in differentiable ops so double backward works."""
    out: tuple[Tensor, Tensor] = _InverseSqrtDegree.apply(env, dst_rowptr, floor)  # type: ignore[no-untyped-call]
    return out


class _InverseSqrtDegree(torch.autograd.Function):
    @staticmethod
    def forward(env: Tensor, dst_rowptr: Tensor, floor: float) -> tuple[Tensor, Tensor]:
        deg = csr_segment_sum(env * env, dst_rowptr).to(env.dtype)
        return deg, torch.rsqrt(deg + floor)

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx,
        inputs: tuple[Tensor, Tensor, float],
        output: tuple[Tensor, Tensor],
    ) -> None:
        env, dst_rowptr, _ = inputs
        ctx.save_for_backward(env, dst_rowptr, output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_deg: Tensor | None, grad_inv: Tensor | None
    ) -> tuple[Tensor | None, None, None]:
        # Imported here: see the package docstring (service/graph/__init__.py).
        from so2kernels._layout import device_constant
        from so2kernels.segment import segment_broadcast

        env, dst_rowptr, inv = ctx.saved_tensors  # type: ignore[attr-defined]
        node: Tensor | None = None
        if grad_inv is not None:  # d rsqrt(deg + f)/d env_e = −inv³·env_e
            zero = device_constant((0.0,), env.device, env.dtype)
            node = torch.addcmul(zero, grad_inv, inv.pow(3), value=-1.0)
        if grad_deg is not None:  # d deg/d env_e = 2·env_e
            node = 2.0 * grad_deg if node is None else torch.add(node, grad_deg, alpha=2.0)
        if node is None:
            return None, None, None
        return segment_broadcast(node, None, dst_rowptr, env.shape[0]) * env, None, None


def build_edge_cache(
    graph: Graph,
    edge_vec: Tensor,
    *,
    rcut: float,
    lmax: int,
    env_exponents: tuple[int, int] = (7, 5),
    deg_floor: float = 0.25,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> EdgeCache:
    """Build the cache from the (E, 3) edge vectors of ``graph``.

    Args:
        env_exponents: ``(radial, message)`` envelope exponents, (7, 5) in the reference.
        deg_floor: added to the degree before ``rsqrt`` (0.25 for checkpoints ≥ v1.1).
        eps: regulariser of the length, ``sqrt(|r|² + eps²)``.
        dtype: compute dtype of every cached tensor (fp32; geometry is never below fp32).
    """
    if edge_vec.shape != (graph.n_edges, 3):
        raise ValueError(f"edge_vec must be ({graph.n_edges}, 3), got {tuple(edge_vec.shape)}")
    vec = edge_vec.to(dtype)
    length = regularised_length(vec, eps)
    rbf_exponent, message_exponent = env_exponents
    env_rbf, env = c3_envelopes(length, rcut, (rbf_exponent, message_exponent))
    quat = edge_quaternion(vec, length, eps)
    deg, inv_sqrt_deg = inverse_sqrt_degree(env, graph.dst_rowptr, deg_floor)
    return EdgeCache(
        vec=vec,
        length=length,
        env=env,
        env_rbf=env_rbf,
        quat=quat,
        wigner=wigner_d(quat, lmax).contiguous(),
        deg=deg,
        inv_sqrt_deg=inv_sqrt_deg,
        graph=graph,
        rcut=rcut,
        lmax=lmax,
        eps=eps,
    )
