"""The run directory: the contract between the engine (writer) and the UI (reader)."""
from .layout import RunPaths
from .reader import RunReader

__all__ = ["RunPaths", "RunReader"]
