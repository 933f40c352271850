"""Exceptions raised by the framework-contract harness."""

from __future__ import annotations


class HarnessError(Exception):
    """Base class for harness errors."""


class CacheInfoError(ValueError, HarnessError):
    """A ModelCacheInfo / CacheEntry description the framework would reject.

    Messages always name the layer index and the entry (cache_name) so that a user
    can find the offending ``cache_entries`` declaration.
    """


class FrameworkImportError(ImportError, HarnessError):
    """A module of a real cann-recipes-infer checkout could not be imported."""


class SchedulerStall(RuntimeError, HarnessError):
    """The scheduler has work but cannot make progress (pool too small)."""
