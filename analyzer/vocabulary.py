"""The manifest's enumerations as plain tuples, importable without pydantic.

``analyzer.manifest`` builds its ``Literal`` types from these and the CLIs build their ``choices``
from them, so `kvcache analyze --help` answers without loading the manifest models.
"""

from __future__ import annotations

DEPLOY_MODES = ("framework", "standalone")
KV_MODES = ("paged", "legacy")
# What the numeric link of a checkout run compares with (`kvcache validate --oracle`): transformers' model on the
# same weights, the recompute oracle (the checkout's own model over each prefix from scratch), or both.
ORACLES = ("both", "transformers", "recompute")
FA_VERSIONS = ("v1", "v2")
# The dtypes a cache can be planned in with --cache-dtype (int8 is a quantized path the bundle does not plan).
PLANNED_CACHE_DTYPES = ("bfloat16", "float16", "float32")
