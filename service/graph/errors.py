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


def _rebuild(
    code: str, message: str, field: str | None, index: int | None
) -> InvalidStructureError:
    return InvalidStructureError(code, message, field=field, index=index)
