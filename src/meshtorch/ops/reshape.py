"""reshape operations (filled in by the operation-library issue)."""

__all__: list[str] = []
