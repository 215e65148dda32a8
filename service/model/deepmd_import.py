"""Import DeePMD-kit DPA4 (SeZM) checkpoints of the supported subset.

The ``.pt`` file is read with ``torch.load(weights_only=True)`` (no pickled code runs). Its
``_extra_state.model_params`` is checked option by option against our subset (model-dpa4.md §11);
anything else is refused with an :class:`UnsupportedCheckpointError` naming the option. Weights are
renamed onto :class:`DPA4Model` (LoRA deltas folded in), the two DeePMD energy biases
(``out_bias`` and ``fitting_net.bias_atom_e``) are merged into our float64 per-element bias, and
``descriptor.version_tensor`` selects the version semantics (1.0 when absent).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model
from service.model.errors import ModelConfigError, UnsupportedCheckpointError

PREFIX = "model.Default.atomic_model."

# DeePMD descriptor options and the only values our subset accepts.
_REQUIRED_DESCRIPTOR_VALUES: dict[str, tuple[Any, ...]] = {
    "type": ("dpa4",),
    "mmax": (1,),
    "extra_node_l": (0,),
    "edge_norm": (False,),
    "so2_norm": (False,),
    "so2_attn_res": ("none",),
    "layer_scale": (False,),
    "mlp_bias": (False,),
    "atten_f_mix": (False,),
    "atten_v_proj": (False,),
    "atten_o_proj": (False,),
    "ffn_so3_grid": (False,),
    "grid_mlp": (False,),
    "grid_branch": (0,),
    "node_wise_s2": (False,),
    "node_wise_so3": (False,),
    "message_node_s2": (False,),
    "message_node_so3": (False,),
    "edge_cartesian": (False,),
    "node_cartesian": ("none", None),
    "so3_readout": ("none",),
    "readout_layers": (1,),
    "full_attn_res": ("none",),
    "block_attn_res": ("none",),
    "activation_function": ("silu",),
    "glu_activation": (True,),
    "add_chg_spin_ebd": (False,),
    "use_spin": (None, False, []),
    "exclude_types": ([],),
    "precision": ("float32",),
    "radial_so2_mode": ("none", "degree_channel"),
    "basis_type": ("bessel", "gaussian"),
    "sandwich_norm": ([False, True, True, False],),
}
_REQUIRED_FITTING_VALUES: dict[str, tuple[Any, ...]] = {
    "type": ("dpa4_ener", "ener"),
    "numb_fparam": (0,),
    "numb_aparam": (0,),
    "dim_case_embd": (0,),
    "activation_function": ("silu",),
    "atom_ener": ([], None),
    "case_film_embd": (False,),
}
_REQUIRED_MODEL_VALUES: dict[str, tuple[Any, ...]] = {
    "type": ("dpa4",),
    "bridging_method": ("None", "none", None),
    "pair_exclude_types": ([],),
    "atom_exclude_types": ([],),
}

# Persistent buffers that carry no learned information (index maps, statistics placeholders).
_IGNORED_SUFFIXES = (
    "expand_index", "balance_weight", "m0_idx", "pos_indices", "neg_indices",
    "kernel_compact_index", "kernel_dense_index", "non_scalar_row_index",
    "zonal_m0_col_index_for_row", "radial_slot_index_for_row", "l1_perm", "l1_sign_outer",
    "coeff_index_m", "degree_index_m", "rotate_inv_rescale_full",
)  # fmt: skip
_IGNORED_KEYS = ("descriptor.mean", "descriptor.stddev", "out_std", "dens_force_rmsd",
                 "descriptor.version_tensor", "out_bias", "fitting_net.bias_atom_e")  # fmt: skip

# DeePMD key (relative to PREFIX) → our state-dict key; \1, \2 are block / layer indices.
_ENV = r"descriptor\.env_seed_embedding\."
_BLOCK = r"descriptor\.blocks\.(\d+)\."
_CONV = _BLOCK + r"so2_conv\."
_FFN = _BLOCK + r"ffns\.(\d+)\."
_FIT = r"fitting_net\.filter_layers\.networks\.0\."
_RENAMES: list[tuple[str, str]] = [
    (r"descriptor\.type_embedding\.adam_type_embedding", "type_embedding"),
    (r"descriptor\.film_scale_strength_log", "film_scale_log"),
    (r"descriptor\.film_shift_strength_log", "film_shift_log"),
    (_ENV + r"rbf_proj_layer1\.matrix", "env_seed.rbf_proj.layers.0.matrix"),
    (_ENV + r"rbf_proj_layer2\.matrix", "env_seed.rbf_proj.layers.1.matrix"),
    (_ENV + r"env_type_embed\.adam_type_embedding", "env_seed.type_table"),
    (_ENV + r"g_layer1\.matrix", "env_seed.filter.layers.0.matrix"),
    (_ENV + r"g_layer2\.matrix", "env_seed.filter.layers.1.matrix"),
    (_ENV + r"output_proj\.matrix", "env_seed.output.matrix"),
    (_BLOCK + r"post_so2_norm\.adam_scale", r"blocks.\1.post_conv_norm.scale"),
    (_BLOCK + r"post_so2_norm\.bias", r"blocks.\1.post_conv_norm.bias"),
    (_BLOCK + r"pre_ffn_norms\.(\d+)\.adam_scale", r"blocks.\1.ffn_norms.\2.scale"),
    (_BLOCK + r"pre_ffn_norms\.(\d+)\.bias", r"blocks.\1.ffn_norms.\2.bias"),
    (_CONV + r"pre_focus_mix\.weight", r"blocks.\1.conv.pre_focus_mix.weight"),
    (_CONV + r"post_focus_mix\.weight", r"blocks.\1.conv.post_focus_mix.weight"),
    (_CONV + r"radial_hidden_proj\.weight", r"blocks.\1.conv.radial_hidden"),
    (_CONV + r"radial_degree_mixer\.weight", r"blocks.\1.conv.mixer_weight"),
    (_CONV + r"radial_degree_mixer\.channel_basis", r"blocks.\1.conv.channel_basis"),
    (_CONV + r"so2_linears\.(\d+)\.weight_m0", r"blocks.\1.conv.linears.\2.weight_m0"),
    (_CONV + r"so2_linears\.(\d+)\.weight_m\.0", r"blocks.\1.conv.linears.\2.weight_m1"),
    (_CONV + r"non_linearities\.(\d+)\.gate_linear\.weight", r"blocks.\1.conv.gates.\2"),
    (_CONV + r"adamw_focus_compete_w", r"blocks.\1.conv.compete_weight"),
    (_CONV + r"attn_qk_norm\.adam_scale", r"blocks.\1.conv.attention.qk_norm.scale"),
    (_CONV + r"attn_q_proj\.weight", r"blocks.\1.conv.attention.q_proj.weight"),
    (_CONV + r"attn_k_proj\.weight", r"blocks.\1.conv.attention.k_proj.weight"),
    (_CONV + r"adamw_attn_logit_w", r"blocks.\1.conv.attention.logit_weight"),
    (_CONV + r"adamw_attn_z_bias_raw", r"blocks.\1.conv.attention.null_raw"),
    (_CONV + r"attn_output_gate_norm\.adam_scale", r"blocks.\1.conv.attention.gate_norm.scale"),
    (_CONV + r"adamw_attn_gate_w", r"blocks.\1.conv.attention.gate_weight"),
    (_FFN + r"so3_linear_1\.weight", r"blocks.\1.ffns.\2.linear_in.weight"),
    (_FFN + r"so3_linear_2\.weight", r"blocks.\1.ffns.\2.linear_out.weight"),
    (_FFN + r"act\.gate_linear\.weight", r"blocks.\1.ffns.\2.gate_weight"),
    (_FFN + r"act\.scalar_gate\.weight", r"blocks.\1.ffns.\2.scalar_gate"),
    (r"descriptor\.output_ffn\.so3_linear_1\.weight", "readout.linear_in.weight"),
    (r"descriptor\.output_ffn\.so3_linear_2\.weight", "readout.linear_out.weight"),
    (_FIT + r"hidden_layers\.(\d+)\.linear\.matrix", r"fitting.hidden.\1.matrix"),
    (_FIT + r"hidden_layers\.(\d+)\.linear\.bias", r"fitting.hidden.\1.bias"),
    (_FIT + r"output_layer\.matrix", "fitting.output.matrix"),
]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_checkpoint(src: Path) -> dict[str, Any]:
    if not src.is_file():
        raise UnsupportedCheckpointError(f"checkpoint not found: {src}")
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or non-torch files
        raise UnsupportedCheckpointError(
            f"cannot read {src} as a DeePMD checkpoint: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(ckpt, dict):
        raise UnsupportedCheckpointError(f"{src}: top level is not a dict")
    state = ckpt.get("model", ckpt)
    if not isinstance(state, dict) or "_extra_state" not in state:
        raise UnsupportedCheckpointError(
            f"{src}: no 'model._extra_state' (not a DeePMD pt checkpoint)"
        )
    return state


def _check_options(
    section: str, values: dict[str, Any], required: dict[str, tuple[Any, ...]]
) -> None:
    for key, allowed in required.items():
        if key in values and values[key] not in allowed:
            raise UnsupportedCheckpointError(
                f"unsupported DeePMD option {section}.{key} = {values[key]!r} "
                f"(supported: {', '.join(repr(a) for a in allowed)})"
            )


def _uniform_schedule(desc: dict[str, Any], key: str, value: int) -> None:
    schedule = desc.get(key)
    if schedule is not None and any(int(v) != value for v in schedule):
        raise UnsupportedCheckpointError(
            f"unsupported DeePMD option descriptor.{key} = {schedule!r} "
            "(per-block schedules/pyramids)"
        )


def config_from_model_params(params: dict[str, Any], version: float) -> ModelConfig:
    """Our :class:`ModelConfig` from DeePMD's normalised ``model_params`` (else refused)."""
    if "model_dict" in params:
        raise UnsupportedCheckpointError("multi-task checkpoints (model_dict) are not supported")
    if params.get("spin") or params.get("use_spin"):
        raise UnsupportedCheckpointError("unsupported DeePMD option spin")
    if params.get("lora") and not isinstance(params["lora"], dict):
        raise UnsupportedCheckpointError(f"unsupported DeePMD option lora = {params['lora']!r}")
    _check_options("model", params, _REQUIRED_MODEL_VALUES)
    desc = dict(params.get("descriptor") or {})
    fit = dict(params.get("fitting_net") or {})
    _check_options("descriptor", desc, _REQUIRED_DESCRIPTOR_VALUES)
    _check_options("fitting_net", fit, _REQUIRED_FITTING_VALUES)
    lmax = int(desc.get("lmax", 3))
    _uniform_schedule(desc, "l_schedule", lmax)
    _uniform_schedule(desc, "m_schedule", 1)
    s2_act = list(desc.get("s2_activation", [False, True]))
    if s2_act[0]:
        raise UnsupportedCheckpointError(
            "unsupported DeePMD option descriptor.s2_activation[0] = True (S2 gate inside SO(2))"
        )
    ffn: Literal["plain", "s2"] = "s2" if s2_act[1] else "plain"
    if ffn == "s2" and not desc.get("lebedev_quadrature", True):
        raise UnsupportedCheckpointError(
            "unsupported DeePMD option descriptor.lebedev_quadrature = False"
        )
    mode = str(desc.get("radial_so2_mode", "degree_channel"))
    rank = int(desc.get("radial_so2_rank", 1))
    if mode == "degree_channel" and not 1 <= rank <= 4:
        raise UnsupportedCheckpointError(
            f"unsupported DeePMD option descriptor.radial_so2_rank = {rank} (need 1..4)"
        )
    try:
        return ModelConfig(
            type_map=tuple(params["type_map"]),
            rcut=float(desc.get("rcut", 6.0)),
            n_radial=int(desc.get("n_radial", 16)),
            basis=str(desc.get("basis_type", "bessel")),  # type: ignore[arg-type]
            radial_mlp=tuple(desc.get("radial_mlp", [0])),
            channels=int(desc.get("channels", 64)),
            lmax=lmax,
            n_blocks=int(desc.get("n_blocks", 3)),
            mixing_layers=int(desc.get("mixing_layers") or desc.get("so2_layers") or 4),
            n_focus=int(desc.get("n_focus", 1)),
            focus_dim=int(desc.get("focus_dim", 0)),
            radial_so2_mode=mode,  # type: ignore[arg-type]
            radial_so2_rank=rank if mode == "degree_channel" else 0,
            n_atten_head=int(desc.get("n_atten_head", 1)),
            ffn=ffn,
            ffn_neurons=int(desc.get("ffn_neurons", 0)),
            ffn_blocks=int(desc.get("ffn_blocks", 1)),
            use_env_seed=bool(desc.get("use_env_seed", True)),
            fitting_neurons=tuple(fit.get("neuron", [0])),
            version=version,
            env_exponents=(
                int(desc.get("env_exp", [7, 5])[0]),
                int(desc.get("env_exp", [7, 5])[1]),
            ),
            eps=float(desc.get("eps", 1e-7)),
        )
    except ModelConfigError as exc:
        raise UnsupportedCheckpointError(
            f"checkpoint configuration outside the subset: {exc}"
        ) from exc


def _rename(key: str) -> str | None:
    for pattern, target in _RENAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, target, key)
    return None


def _fold_lora(weights: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """Fold LoRA adapters into their base weights (model-dpa4.md §8 item 12) and drop them.

    SO3Linear ``A_by_l (L+1, r, in)``, ``B_by_l (L+1, out, r)``: ``W(l,i,o) += Σ_r B·A · s``;
    SO2Linear ``A_m0``/``A_m.k (r, in)``, ``B_* (out, r)``: ``W(i,o) += Aᵀ Bᵀ · s``.
    """
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".A_by_l")]:
        parent = key[: -len("A_by_l")]
        a, b = out.pop(key), out.pop(parent + "B_by_l")
        base = _lora_base(out, parent, "weight")
        out[base] = out[base] + torch.einsum("lor,lri->lio", b, a) * scaling
    for key in [k for k in weights if re.search(r"\.A_(m0|m\.\d+)$", k)]:
        found = re.fullmatch(r"(.*\.)A_(m0|m\.\d+)", key)
        assert found is not None
        parent, suffix = found.groups()
        a, b = out.pop(key), out.pop(f"{parent}B_{suffix}")
        base = _lora_base(out, parent, "weight_" + suffix)
        out[base] = out[base] + (a.T @ b.T) * scaling
    return out


def _lora_base(weights: dict[str, Tensor], parent: str, name: str) -> str:
    for candidate in (parent + name, re.sub(r"lora\.$", "", parent) + name):
        if candidate in weights:
            return candidate
    raise UnsupportedCheckpointError(f"LoRA adapter at {parent!r} has no base weight {name!r}")


def map_state_dict(state: dict[str, Any], config: ModelConfig) -> dict[str, Tensor]:
    """Our model's state dict from a DeePMD state dict (every learned tensor accounted for)."""
    weights = {
        k[len(PREFIX) :]: v
        for k, v in state.items()
        if k.startswith(PREFIX) and isinstance(v, Tensor)
    }
    lora = (state["_extra_state"].get("model_params") or {}).get("lora") or {}
    weights = _fold_lora(weights, float(lora.get("scaling", lora.get("lora_scaling", 1.0))))
    mapped: dict[str, Tensor] = {}
    for key, value in weights.items():
        if key in _IGNORED_KEYS or key.endswith(_IGNORED_SUFFIXES):
            continue
        radial = re.fullmatch(r"descriptor\.radial_embedding\.net\.(\d+)\.matrix", key)
        if radial:
            mapped[f"radial_mlp.layers.{int(radial.group(1)) // 2}.matrix"] = value
            continue
        if key == "descriptor.radial_basis.adam_freqs":
            mapped["radial_basis.freqs"] = value.reshape(-1)
            continue
        target = _rename(key)
        if target is None:
            raise UnsupportedCheckpointError(
                f"checkpoint tensor {key!r} has no counterpart in our model"
            )
        mapped[target] = value
    n_types = config.n_types
    out_bias = weights.get("out_bias", torch.zeros(1, n_types, 1, dtype=torch.float64))
    atom_bias = weights.get("fitting_net.bias_atom_e", torch.zeros(n_types, 1, dtype=torch.float64))
    mapped["energy_bias"] = out_bias.reshape(-1)[:n_types].double() + atom_bias.reshape(-1).double()
    return mapped


def load_deepmd_checkpoint(src: str | Path) -> tuple[DPA4Model, dict[str, Any]]:
    """``(model, provenance)`` from a DeePMD DPA4 ``.pt`` checkpoint (float32, eval mode)."""
    path = Path(src)
    state = _read_checkpoint(path)
    extra = state["_extra_state"]
    params = extra.get("model_params") if isinstance(extra, dict) else None
    if not isinstance(params, dict):
        raise UnsupportedCheckpointError(f"{path}: _extra_state has no model_params")
    version_key = PREFIX + "descriptor.version_tensor"
    version = float(state[version_key]) if version_key in state else 1.0
    version = round(version, 3)
    config = config_from_model_params(params, version)
    model = DPA4Model(config)
    mapped = map_state_dict(state, config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise UnsupportedCheckpointError(f"checkpoint lacks tensors for: {', '.join(missing)}")
    for key, value in mapped.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise UnsupportedCheckpointError(
                f"shape mismatch for {key}: checkpoint {tuple(value.shape)}, "
                f"model {tuple(expected[key].shape)}"
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in mapped.items()})
    model.eval()
    provenance = {
        "source": "deepmd-kit",
        "source_file": path.name,
        "source_sha256": _sha256(path),
        "deepmd_version": str(extra.get("deepmd_version", params.get("deepmd_version", "unknown"))),
        "train_infos": extra.get("train_infos", {}),
    }
    return model, provenance


def import_deepmd_checkpoint(src: str | Path, dst: str | Path) -> ModelConfig:
    """Convert a DeePMD DPA4 checkpoint into our model file; returns the mapped config."""
    from service.model.io import save_model

    model, provenance = load_deepmd_checkpoint(src)
    save_model(model, dst, provenance=provenance)
    return model.config
