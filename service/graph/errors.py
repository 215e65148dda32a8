"""Typed input errors of the graph layer (the service maps them to HTTP 422)."""

from __future__ import annotations


class InvalidStructureError(ValueError):
    """A structure cannot be evaluated as given.

    Attributes:
        code: machine-readable reason, e.g. ``'non_finite_positions'``, ``'ragged_positions'``,
            ``'singular_cell'``, ``'unknown_element'``, ``'coincident_atoms'``,
            ``'too_many_atoms'``, ``'bad_pbc'``.
        field: where in the request the problem is, e.g. ``'structures[3].positions'``.
        index: index of the offending structure in its batch, or ``None`` when not tied to one.
    """

    def __init__(
        self, code: str, message: str, *, field: str | None = None, index: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.index = index

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments survive pickling (worker processes) only through this hook.
        return (_rebuild, (self.code, self.message, self.field, self.index))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready description: ``{"code", "message", "field", "index"}``."""
        return {
            "code": self.code,
            "message": self.message,
            "field": self.field,
            "index": self.index,
        }


MAX_IMAGE_WINDOW = 2**21
"""Periodic images one atom's search may visit; a cell far thinner than the cutoff (which
validation would have refused) needs more and is rejected as singular."""


def thin_cell_error(structure: int, n_images: float) -> InvalidStructureError:
    """``singular_cell``: more than :data:`MAX_IMAGE_WINDOW` images within the cutoff."""
    return InvalidStructureError(
        "singular_cell",
        f"structure {structure}: the cell is so thin that {n_images:.3g} periodic images lie "
        "within the cutoff",
        field=f"structures[{structure}].cell",
        index=structure,
    )


def coincident_atoms_error(
    structure: int, pair: tuple[int, int], shift: object, distance: float, min_distance: float,
    field_prefix: str = "structures",
) -> InvalidStructureError:  # fmt: skip
    """``coincident_atoms``: atoms ``pair`` (numbered within the structure) closer than
    ``min_distance`` Å through image ``shift``, or one atom and its own image."""
    i, j = pair
    what = (
        f"atom {i} coincides with its own periodic image {shift}"
        if i == j
        else f"atoms {i} and {j} (image {shift}) are coincident"
    )
    return InvalidStructureError(
        "coincident_atoms",
        f"structure {structure}: {what}: distance {distance:.3g} Å < {min_distance:g} Å",
        field=f"{field_prefix}[{structure}].positions",
        index=structure,
    )


def _rebuild(
    code: str, message: str, field: str | None, index: int | None
) -> InvalidStructureError:
    return InvalidStructureError(code, message, field=field, index=index)
