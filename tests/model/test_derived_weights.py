"""The derived-weight cache (folded and packed weights, built once per weights version)."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from service.model.layers.derived import derived_weights


def _owner() -> tuple[nn.Module, list[int]]:
    owner = nn.Module()
    owner.w = nn.Parameter(torch.ones(3))
    return owner, []


def _doubled(owner: nn.Module, builds: list[int]) -> torch.Tensor:
    def build() -> torch.Tensor:
        builds.append(1)
        return owner.w.detach() * 2

    out: torch.Tensor = derived_weights(owner, "doubled", [owner.w], build, live=False)
    return out


def test_built_once_per_version() -> None:
    owner, builds = _owner()
    first = _doubled(owner, builds)
    assert _doubled(owner, builds) is first and len(builds) == 1
    with torch.no_grad():
        owner.w.mul_(3.0)  # an optimiser step bumps the version
    assert torch.equal(_doubled(owner, builds), torch.full((3,), 6.0)) and len(builds) == 2


def test_a_new_parameter_at_the_same_address_and_version_rebuilds() -> None:
    """``load_state_dict(assign=True)`` can put a new tensor where a freed one lived, with the
    same version: the address and version alone would hand back the old tensor's weights."""
    owner, builds = _owner()
    _doubled(owner, builds)
    before = (owner.w.data_ptr(), owner.w._version)
    replacement = nn.Parameter(owner.w.data)  # same storage, a fresh version counter
    replacement.data.copy_(torch.full((3,), 5.0))  # through .data: no version bump
    owner.w = replacement
    assert (owner.w.data_ptr(), owner.w._version) == before
    assert torch.equal(_doubled(owner, builds), torch.full((3,), 10.0)) and len(builds) == 2


def test_copies_rebuild_for_their_own_parameters() -> None:
    owner, builds = _owner()
    _doubled(owner, builds)
    for clone in (copy.deepcopy(owner), pickle.loads(pickle.dumps(owner))):
        with torch.no_grad():
            clone.w.fill_(4.0)
        assert torch.equal(_doubled(clone, builds), torch.full((3,), 8.0))
    assert torch.equal(_doubled(owner, builds), torch.full((3,), 2.0))
