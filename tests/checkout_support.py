"""The numeric oracle the checkout-mode tests ask for when they are not about the oracles themselves.

`kvcache validate --framework-root` compares the cached run with transformers and, by default (``--oracle both``),
with the recompute oracle too: every row of the judged stream prefilled again from scratch by the checkout's own model
(validators/checkout_run/recompute.py), a second pass over the whole stream that costs seconds per run (half of a
gemma-4 run). A test that judges something else (an init, runtime or release check, the transformers comparison,
a reading sweep, a note) asks for the transformers oracle alone: the checks it asserts are computed the same way,
and V301/V302 still judge every logit. The recompute oracle's own tests (V305/V306, and the note naming which
oracle failed: tests/test_checkout_recompute.py) keep it, and run the default (``both``) end to end.
"""

from __future__ import annotations

ORACLE = "transformers"
