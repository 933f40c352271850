"""Realistic mistakes edited into renders of a sliding-window model (Mistral-7B: window 4096, too long for a
CPU stream, so a render that differs from the implementer's also runs as written at its real window).

One list for the failing-validation test and for ``benchmarks/bench_failing_validate.py``: (case id, analyze
flags, rendered file, regex, replacement, the check that must name it). Paged and Legacy, both modes.
"""

from __future__ import annotations

CONFIG = "mistral_7b_v01"
FRAMEWORK = {"deploy_mode": "framework", "framework_api": "G2"}
STANDALONE = {"deploy_mode": "standalone"}
LEGACY = {"kv_mode": "legacy"}
ARGS = "FA call arguments match the manifest"
NUMERIC = "logits vs transformers"

ATTN, RUNNER = "kvcache_attention.py", "kvcache_runner.py"
MISTAKES = [
    # Legacy: the band dropped on the decode call, the window off by one, a KV length without the step's tokens
    ("legacy-framework-decode-band", {**LEGACY, **FRAMEWORK}, ATTN,
     r"        sparse_mode = 4\n", "        sparse_mode = 4 if forward_metadata.is_prefill else 0\n", ARGS),
    ("legacy-framework-window-off-by-one", {**LEGACY, **FRAMEWORK}, ATTN,
     r"WINDOW_PRE_TOKENS_OFFSET = 1 ", "WINDOW_PRE_TOKENS_OFFSET = 0 ", ARGS),
    ("legacy-standalone-window-off-by-one", {**LEGACY, **STANDALONE}, ATTN,
     r"WINDOW_PRE_TOKENS_OFFSET = 1 ", "WINDOW_PRE_TOKENS_OFFSET = 0 ", ARGS),
    ("legacy-standalone-kv-without-own-tokens", {**LEGACY, **STANDALONE}, RUNNER,
     r"actual_seq_lengths_kv=self\.kv_len \+ q_lens,", "actual_seq_lengths_kv=self.kv_len,", NUMERIC),
    # Paged: the same kinds of mistakes
    ("paged-framework-decode-band", FRAMEWORK, ATTN,
     r"        sparse_mode = 4\n", "        sparse_mode = 4 if forward_metadata.is_prefill else 0\n", ARGS),
    ("paged-framework-window-off-by-one", FRAMEWORK, ATTN,
     r"WINDOW_PRE_TOKENS_OFFSET = 1 ", "WINDOW_PRE_TOKENS_OFFSET = 0 ", ARGS),
    ("paged-standalone-kv-without-own-tokens", STANDALONE, RUNNER,
     r"kv_lens = self\.kv_len\[index\] \+ 1", "kv_lens = self.kv_len[index]", NUMERIC),
]
CLEAN = {"legacy-framework": {**LEGACY, **FRAMEWORK}, "legacy-standalone": {**LEGACY, **STANDALONE},
         "paged-framework": FRAMEWORK, "paged-standalone": STANDALONE}


def clean_case(flags: dict) -> str:
    return next(name for name, clean in CLEAN.items() if clean == flags)
