"""DeepSeek sparse attention (MLA + a lightning indexer with its own key cache), analyzer side.

The attention reads the latent and rope caches like MLA, but only at the top ``index_topk`` keys the indexer
selects, through ``npu_sparse_flash_attention`` (not FA): FA's query-head rule does not apply, and each layer that
runs its own indexer caches one indexer key per token.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds.gqa import Facts
from model_infer_kvcache.analyzer.kinds.mla import MlaFormat
from model_infer_kvcache.analyzer.manifest import INDEXER_KEY_CACHE, CacheSpec, DsaDecision, Finding
from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA


class DsaFormat(MlaFormat):
    name = "dsa"
    hf_projections = ()  # MLA's, which the MLA format already names
    doc_example = ("MLA + DeepSeek 稀疏注意力(DSA,indexer key cache)", "DeepSeek-V3.2、GLM-5、A.X-K2",
                   {"model_type": "deepseek_v32", "num_key_value_heads": 8, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
                    "index_n_heads": 64, "index_head_dim": 128})
    fa_call = False  # the sparse FA over the indexer's top-k: no FA version, FA layout or FA path table

    def decision_rows(self, m) -> list[tuple[str, str, str]]:
        d = m.dsa
        shared = f", {len(d.shared_layers)} 层复用上一层的选择" if d.shared_layers else ""
        shared += f", {len(d.dense_layers)} 层为稠密注意力(无 indexer)" if d.dense_layers else ""
        return [("DSA 稀疏注意力", f"index_topk={d.index_topk}, indexer_key_cache {d.indexer_cache.dim}x1 "
                 f"{d.indexer_cache.dtype}, {len(d.indexer_layers)} 层各有 indexer{shared}, 每卡 indexer heads "
                 f"{d.index_n_heads_per_rank}", f"{d.reason}; 选择: {d.selection}; key: {d.key_transform}")]

    def fa_attends(self, facts: Facts, layers: tuple[int, ...]) -> bool:
        """Dense layers beside the indexed ones (Dots3-Note's sliding layers) attend through FA itself; indexed ones
        through npu_sparse_flash_attention."""
        return bool(layers) and set(layers) <= set(facts.dsa.value.dense)

    def dims_note(self, facts: Facts, layers: tuple[int, ...]) -> str:
        """MLA's latent / rope dims, sourced as what they are on the indexed layers: the pinned
        npu_sparse_flash_attention doc states no head dims, and the path is known at upstream deepseek_v3_2_exp's
        (latent 512, rope 64) only, so it is held to MLA's FA dims rather than widened on no evidence. Dense layers
        beside them (Dots3-Note's sliding layers) attend through FA itself."""
        if self.fa_attends(facts, layers):
            return ""
        return (" (DSA: the sparse-FA path is known at MLA's FA dims only; the pinned npu_sparse_flash_attention doc "
                "states none)")

    def hf_facts(self, module) -> dict[str, int | None]:
        """Whether an MLA module runs its own indexer (DeepseekV32Attention.indexer; None on GLM-5's shared layers
        and on Dots3-Note's dense ones), beside MLA's latent widths."""
        if getattr(module, "kv_a_proj_with_mqa", None) is None:
            return {}
        return {"indexer": 1 if getattr(module, "indexer", None) is not None else None}

    def hf_off(self, layer, module_facts: dict[str, int | None], cls: str) -> str | None:
        """Where the layer's indexer key cache and the module's own indexer disagree; then MLA's comparison."""
        rest = dict(module_facts)
        held = rest.pop("indexer", None) is not None
        planned = INDEXER_KEY_CACHE in [c.name for c in layer.caches]
        if held != planned:
            return (f"DSA indexer: analyzer plans {'an' if planned else 'no'} indexer key cache vs transformers "
                    f"{cls}.indexer {'set' if held else 'None'}")
        return super().hf_off(layer, rest, cls)

    def heads_problem(self, facts: Facts, parallel, layers: tuple[int, ...] | None = None) -> Finding | None:
        """The sparse FA's query heads are not FA's MLA head rule; the dense layers beside the indexed ones
        (Dots3-Note's sliding layers) attend through FA, which holds them to it."""
        dense = facts.dsa.value.dense
        return super().heads_problem(facts, parallel, tuple(dense)) if dense else None

    def call_row(self, m) -> tuple[str, str, str]:
        return call_row(m)

    def doc_attention(self, m) -> str:
        return "不用 FA:`npu_lightning_indexer` 选 top-k,`npu_sparse_flash_attention` 只读选中的 key,已渲染"

    def doc_layout(self, m) -> str:
        return "TND(缓存 PA_BSND)"  # the sparse FA's, not FA's

    def doc_write(self, m) -> str:
        return super().doc_write(m) + " + `npu_scatter_nd_update_`(indexer key)"

    def sections(self, facts: Facts, layers, groups, parallel, dtype: str, block_size: int,
                 max_len: int | None) -> dict:
        return {"dsa": decide(facts, dtype)}

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        caches = super().caches(facts, tp, kv_mode, dtype, decoder_layer)
        dsa = facts.dsa.value
        if decoder_layer is not None and dsa.own_indexer[decoder_layer]:
            caches.append(indexer_cache(dsa, dtype))
        return caches


def indexer_cache(dsa, dtype: str) -> CacheSpec:
    """The indexer key cache entry (upstream deepseek_v3_2_exp: ``CacheEntry("indexer_key_cache", dim=index_head_dim,
    num_head=1)`` in the nope cache's dtype, unquantized path): one key per token, shared by all indexer heads, so
    attention TP never splits it."""
    return CacheSpec(name=INDEXER_KEY_CACHE, dim=dsa.index_head_dim, num_head=1, dtype=dtype)


def decide(facts: Facts, dtype: str | None = None) -> DsaDecision | None:
    """DeepSeek sparse attention: the indexer key cache and the top-k selection, from the config's index_* fields
    (transformers ``deepseek_v32`` / ``glm_moe_dsa``: ``DeepseekV32Indexer``); None for dense attention."""
    dsa = facts.dsa.value
    if dsa is None:
        return None
    rope = facts.mla.value.qk_rope_head_dim
    own = [i for i, runs in enumerate(dsa.own_indexer) if runs]
    shared = [i for i, runs in enumerate(dsa.own_indexer) if not runs and i not in dsa.dense]
    return DsaDecision(
        index_topk=dsa.index_topk,
        index_n_heads=dsa.index_n_heads,
        # Replicated, not split: the top-k needs each key's score summed over every indexer head, so split heads
        # would all-reduce a [tokens, keys] matrix per layer (upstream deepseek_v3_2_exp: ReplicatedLinear wq_b
        # over all index_n_heads on every attention-TP rank).
        index_n_heads_per_rank=dsa.index_n_heads,
        index_head_dim=dsa.index_head_dim,
        indexer_cache=indexer_cache(dsa, dtype or facts.dtype.value),
        indexer_layers=own,
        shared_layers=shared,
        dense_layers=list(dsa.dense),
        index_rope=dsa.rope,
        key_transform="k = LayerNorm(wk(hidden_states)) (eps 1e-6), then "
                      + ("half-split (not interleaved, unlike the MLA rope)" if dsa.rope == "half" else
                         "interleaved-pair (like the MLA rope)")
                      + f" RoPE on its {dsa.rope_dims} {rope} dims ({dsa.rope_source}), then written at the token's slot: a key "
                      "cached before its RoPE scores every later query wrongly",
        selection=f"per query: score_t = sum over indexer heads of weight_h * relu(q_h . k_t) * "
                  f"{dsa.index_head_dim}^-0.5, over that request's own causal keys only; the top "
                  f"{dsa.index_topk} keys (all of them while the sequence is shorter) feed the MLA attention",
        source=dsa.sources,
        reason=f"index_topk {dsa.index_topk} in the config: dense attention would read every key and differ from "
               f"the model for any sequence longer than {dsa.index_topk}; the indexer keys need their own cache "
               f"entry ({dsa.index_head_dim} x 1 head per token) in the layer's blocks; every attention-TP rank "
               f"runs all {dsa.index_n_heads} indexer heads (its top-k sums over them)",
    )


def call_row(m) -> tuple[str, str, str]:
    """DSA's attention call, in place of the FA version / input_layout / sparse_mode rows: no FA call is made."""
    return ("稀疏注意力调用",
            f"{SPARSE_FA.op}, layout_query {SPARSE_FA.layout_query} / layout_kv {SPARSE_FA.layout_kv}, "
            f"sparse_mode {SPARSE_FA.sparse_mode}(prefill 与 decode), 每个 query 读 index_topk={m.dsa.index_topk} 个 key",
            "DSA attends through the sparse FA over the lightning indexer's top-k keys (MLA absorb: query "
            "q_nope x W_UK with q_pe, over the latent and rope caches); no FA call, so the FA version, FA input_layout "
            "and the FA path table's sparse_mode / mask do not apply")


FORMAT = DsaFormat()
