"""Cache kinds, analyzer side: each kind's config facts, cache entries, memory groups and decision in one module.

The render side of the same kinds lives in ``implementer/kinds/``; the group block math every kind sizes its pools
with stays in ``analyzer/kv_cache_spec.py``.
"""
