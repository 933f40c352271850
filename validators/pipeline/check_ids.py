"""Every validation check, with its stable ID: the one registry the reports, the docs and SKILL.md read.

Like lint's KVxxx rules, a check keeps its ID for good: V1xx init, V2xx runtime, V3xx numeric, V4xx release.
``name`` is the template a report writes, ``<N>`` standing for a formatted value; a run's own prefixes
(``as written: ``, ``rank N: ``) are not part of it. ``Report.add`` refuses a name no entry matches, so a
new check cannot be reported without an ID, and ``references/validation.md`` lists exactly these rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

LINKS = ("init", "runtime", "numeric", "release")


@dataclass(frozen=True)
class CheckDef:
    id: str
    link: str
    name: str  # template: "<N>" marks a formatted value

    @property
    def pattern(self) -> re.Pattern:
        return _compiled(self.name)


@cache
def _compiled(template: str) -> re.Pattern:
    return re.compile("^" + ".+?".join(re.escape(part) for part in template.split("<N>")) + "$")


CHECKS: tuple[CheckDef, ...] = (
    # ---------------------------------------------------------------- init: what exists before the first step
    CheckDef("V101", "init", "cache entries match the manifest"),
    CheckDef("V102", "init", "get_cache_info layer count"),
    CheckDef("V103", "init", "is_mla_backend"),
    CheckDef("V104", "init", "placeholders replaced by [num_blocks, block_size, num_head, dim]"),
    CheckDef("V105", "init", "allocate_cache_tensors gave every entry a tensor"),
    CheckDef("V106", "init", "the checkout's loader filled every parameter from the checkpoint"),
    CheckDef("V107", "init", "every layer's attn_type, window and cache entries match the manifest (<N> layers)"),
    CheckDef("V108", "init", "rendered constants match the manifest"),
    CheckDef("V109", "init", "rendered runner present"),
    CheckDef("V110", "init", "_init_kvcache caches are [num_blocks, block_size, num_head, dim]"),
    CheckDef("V111", "init", "static block table is arange(batch * blocks_per_seq)"),
    CheckDef("V112", "init", "cache_unit matches the manifest"),
    CheckDef("V113", "init", "contiguous caches are [batch, max_seq_len, N_kv*D]"),
    CheckDef("V114", "init", "rendered runner builds speculative-decode verify steps"),
    CheckDef("V115", "init", "runner's own caches hold every layer's keys and values for the longest sequence "
                             "(<N> layers)"),
    # ---------------------------------------------------------------- runtime: every step of the stream
    CheckDef("V116", "init", "cross-attention slot entries match the manifest (<N> layers)"),
    CheckDef("V117", "init", "byte patches: every stack's paged pool is its planned layers x [num_blocks, block_size, "
                             "KV heads, head_dim] (<N> layers)"),
    CheckDef("V201", "runtime", "rendered code runs without operator errors"),
    CheckDef("V202", "runtime", "checkout model runs in the engine without errors"),
    CheckDef("V203", "runtime", "request stream finishes within its step budget"),
    CheckDef("V204", "runtime", "rank <N>: finished"),
    CheckDef("V205", "runtime", "block_table/slot_mapping hold every layer's key"),
    CheckDef("V206", "runtime", "shapes around the attention call (FA or sparse FA) match the entries"),
    CheckDef("V207", "runtime", "softmax scale equals the model's attention scaling"),
    CheckDef("V208", "runtime", "first decode reads prompt length + 1"),
    CheckDef("V209", "runtime", "FA call arguments match the manifest"),
    CheckDef("V210", "runtime", "slot_mapping = row * max_seq_len + position"),
    CheckDef("V211", "runtime", "speculative-decode verify steps (q_len <N>) pass the manifest's MTP sparse_mode/mask"),
    CheckDef("V212", "runtime", "verify-step slot_mapping = row * max_seq_len + position (1 + next_n per row)"),
    CheckDef("V213", "runtime", "kv_len advances by 1 + accepted drafts after a verify step"),
    CheckDef("V214", "runtime",
             "each layer's FA (once per step) reads that layer's cache (prefill may read its fresh K/V)"),
    CheckDef("V215", "runtime", "kv_len reaches every layer as the engine set it (never changed inside a layer)"),
    CheckDef("V216", "runtime", "FA block_table is the layer's own group's"),
    CheckDef("V217", "runtime", "cache writes use the layer's own group's slot_mapping"),
    CheckDef("V218", "runtime", "every cache entry is written every step"),
    CheckDef("V219", "runtime", "decode padded to the per-DP batch size; padded rows write only the null block"),
    CheckDef("V220", "runtime", "the Legacy render keeps the model's own attention (no FA call)"),
    CheckDef("V221", "runtime", "sparse attention: scale, causal sparse_mode 3 and index_topk keys per query as the "
                                "manifest"),
    CheckDef("V222", "runtime", "each indexer layer's lightning indexer reads that layer's indexer key cache (own "
                                "table, kv lengths, sparse_count = index_topk)"),
    CheckDef("V223", "runtime", "each linear layer writes exactly its requests' state blocks every step (block_table "
                                "Mamba)"),
    CheckDef("V224", "runtime", "runner's own prefill and decode run without errors"),
    CheckDef("V225", "runtime", "each decode step writes every row's cache at the new token's position only "
                                "(<N> steps)"),
    CheckDef("V226", "runtime", "each step feeds every request its own tokens at its own positions, in its own row "
                                "(<N> rows over <N> steps)"),
    CheckDef("V227", "runtime", "each step writes every request's keys and values in its own row's blocks at its own "
                                "positions (<N> steps)"),
    CheckDef("V228", "runtime", "graph mode (<N>): the decode step captures as one graph"),
    CheckDef("V229", "runtime", "graph mode: no capture after warm-up (<N> captures for <N> batch sizes over <N> "
                                "replays)"),
    CheckDef("V230", "runtime", "graph mode: no tensor inside the captured step is shaped or filled from a host length"),
    CheckDef("V231", "runtime", "cross-attention reads each request's encoder K/V unmasked (sparse_mode 0, KV length = "
                                "its encoder length)"),
    CheckDef("V232", "runtime", "shared-KV attention: each layer's window branch, compressed branch and sinks as the "
                                "manifest"),
    CheckDef("V233", "runtime", "drafter: each layer's FA reads the target's last layer of its attn_type through "
                                "its block table (<N> layers)"),
    CheckDef("V234", "runtime", "byte patches: each FA call reads its stack's own paged cache at the request's bytes "
                                "(the global stack at its completed patches, at the bytes transformers' patcher ends "
                                "them) (<N> calls)"),
    CheckDef("V235", "runtime", "QSA selection: each query reads the tokens of its top blocks (min(block_topk, visible "
                                "blocks) whole blocks) and of its tail block, causally, each once"),
    # ---------------------------------------------------------------- numeric: against transformers
    CheckDef("V301", "numeric", "logits vs transformers max |diff| <= <N>"),
    CheckDef("V302", "numeric", "greedy tokens identical to transformers"),
    CheckDef("V303", "numeric", "request stream crosses the window by >= 2 blocks (<N> tokens) on both paths"),
    CheckDef("V304", "numeric", "speculative decode (next_n=<N>): verify logits vs transformers max |diff| <= <N>"),
    CheckDef("V305", "numeric", "logits vs recompute (the model's own forward over the whole prefix, no cache) max "
                                "|diff| <= <N>"),
    CheckDef("V306", "numeric", "greedy tokens identical to recompute"),
    CheckDef("V307", "numeric", "graph mode: replayed decode logits vs eager max |diff| <= <N>"),
    CheckDef("V308", "numeric", "drafter logits vs transformers (the same K/V dense as shared_kv_states) max |diff| "
                                "<= <N>"),
    # ---------------------------------------------------------------- release: back where it started
    CheckDef("V309", "numeric", "byte patches: logits vs transformers' full forward (each request's bytes, no cache) "
                                "max |diff| <= <N>"),
    CheckDef("V310", "numeric", "byte patches: greedy bytes identical to transformers' full forward"),
    CheckDef("V401", "release", "outputs finite with unowned cache (freed, null, unwritten) poisoned (NaN)"),
    CheckDef("V402", "release", "all blocks back in the pool after the stream"),
    CheckDef("V403", "release", "<N> sequential requests leave the pool and memory unchanged"),
    CheckDef("V404", "release", "<N> sequential requests leave memory unchanged"),
    CheckDef("V405", "release", "all blocks back in the pool after the speculative-decode stream"),
    CheckDef("V406", "release", "cache tensors unchanged by the stream (bytes)"),
    CheckDef("V407", "release", "the runner's caches are allocated once and kept by every step and call "
                                "(<N> steps)"),
    CheckDef("V408", "release", "byte patches: every stack's blocks back in the pool and no per-request state left "
                                "after the stream"),
)
BY_ID = {c.id: c for c in CHECKS}
# A run's own prefixes on a check name: the as-written rerun of a long-window render, a rank of a TP run.
_PREFIX = re.compile(r"^(?:as written: |rank \d+: )")


class UnregisteredCheck(ValueError):
    """A check name no registry entry matches: register it (with a new ID) before reporting it."""


def check_def(link: str, name: str) -> CheckDef:
    """The registered check ``name`` (a report's name, prefixes allowed) of ``link`` is an instance of."""
    candidates = [name]
    while _PREFIX.match(candidates[-1]):
        candidates.append(_PREFIX.sub("", candidates[-1], count=1))
    for text in candidates:
        for check in CHECKS:
            if check.link == link and check.pattern.match(text):
                return check
    raise UnregisteredCheck(f"check {name!r} ({link}) is not in validators/pipeline/check_ids.py")
