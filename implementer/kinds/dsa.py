"""DeepSeek sparse attention: MLA's caches plus each layer's indexer key cache, the sparse FA over the indexer's
top-k (templates/kinds/dsa_attention.py.j2, inside the MLA partial)."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds import mla
from model_infer_kvcache.implementer.kinds.common import bad

NAME = "DSA"
CACHE_NAMES = (*mla.CACHE_NAMES, "indexer_key_cache")
# each cache's rendered (width constant, per-token heads)
CACHE_CONSTANTS = {**mla.CACHE_CONSTANTS, "indexer_key_cache": ("INDEX_HEAD_DIM", "1")}
LAYOUTS = mla.LAYOUTS


def check_layers(m) -> None:
    if m.dsa.dense_layers:
        raise bad("dsa.dense_layers", f"{len(m.dsa.dense_layers)} layer(s) attend densely beside the indexed ones "
                                      f"(first: {m.dsa.dense_layers[0]}); no template mixes MLA's FA layers with "
                                      "sparse-FA layers")
    if m.dsa.shared_layers:
        raise bad("dsa.shared_layers", f"{len(m.dsa.shared_layers)} layer(s) reuse the previous layer's top-k "
                                       f"selection (first: {m.dsa.shared_layers[0]}); no template carries a "
                                       "selection across layers")


def check(m) -> None:
    mla.check(m)
    if not m.mla.rope:
        raise bad("mla.rope", "position-free MLA with a DSA indexer is not rendered (the indexer rotates its keys)")


def fields(m) -> dict:
    d = m.dsa
    return {**mla.fields(m), "is_dsa": True, "index_topk": int(d.index_topk),
            "index_n_heads": int(d.index_n_heads_per_rank), "index_head_dim": int(d.index_head_dim),
            "index_rope": d.index_rope}
