"""Bundle version (kept in one place; rendered-file headers quote it)."""

__version__ = "0.1.0"
