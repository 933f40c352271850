"""Qwen4-Exp's QSA (block-sparse GQA attention over pooled indexer keys), analyzer side.

transformers ``Qwen4ExpTextQSAIndexer._select_tokens``: per query, the mean of every complete block of
``indexer_compress_ratio`` raw indexer keys (k_layernorm'd, RoPE'd at the block's first position) is scored by
``sum_h relu(q_h . k) / sqrt(indexer_head_dim)``; the top ``indexer_budget // indexer_compress_ratio`` blocks and the
incomplete tail block are the tokens the layer's GQA attention may read. On the pinned ops: the lightning indexer over
a paged cache of the pooled block keys, then the sparse FA over the layer's K/V with the selected blocks' tokens.

Each attention layer keeps, beside its K/V, two single-head ``indexer_head_dim`` entries in the same blocks: the raw
indexer key of every token (a block is pooled once its last token is written, reading its tokens back) and the pooled
block key of block j at the slot of the request's position j (j < the position that completes it, so its block is
always allocated; 1 of ``ratio`` rows used, the price of sharing the layer's table and manager). At the released
sizes that is 2 x 128 values per token beside K/V's 2 x 2 x 256 (+25% per attention layer); a ring of ``ratio - 1``
raw keys per request and the pooled keys in a manager of ``block_size x ratio``-token blocks (as DeepSeek-V4's
compressed entries) would cost about +3%, and are not planned yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import InputError, NotSupportedByKvcache
from model_infer_kvcache.analyzer.kinds.gqa import MASK_REWRITTEN, Facts, GqaFormat
from model_infer_kvcache.analyzer.kinds.invariants import QSA_CACHES
from model_infer_kvcache.analyzer.manifest import CacheSpec, QsaDecision
from model_infer_kvcache.analyzer.operators.fa_facts import SPARSE_FA

RAW_KEY_CACHE, BLOCK_KEY_CACHE = QSA_CACHES
SOURCE = "transformers/models/qwen4_exp/modeling_qwen4_exp.py:Qwen4ExpTextQSAIndexer"
# the op docs the route follows: npu_lightning_indexer, npu_sparse_flash_attention, its sparse_indices (valid first)
OP_DOCS = "torch_npu-2.14.0 _op_plugin_docs.py:1371, :1474, :1481; 2.9.0: :8752, :8854, :8861"
# the config fields Qwen4ExpTextAttention.__init__ builds its indexer from, whatever the config says
FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
MODEL_TYPES = ("qwen4_exp_text",)
Getter = Callable[[str], Any]


@dataclass(frozen=True)
class QsaFacts:
    n_heads: int
    head_dim: int
    budget: int
    ratio: int
    rope_dim: int  # the first rope_dim dims of an indexer head rotate (the model's partial rotary span)
    source: str

    @property
    def block_topk(self) -> int:
        return self.budget // self.ratio


def _rotary_factor(get: Getter) -> float:
    """partial_rotary_factor as Qwen4ExpTextRotaryEmbedding reads it (rope_parameters', default 1.0)."""
    rope = get("rope_parameters")
    if rope is not None and isinstance(rope[0], dict) and rope[0].get("partial_rotary_factor") is not None:
        return float(rope[0]["partial_rotary_factor"])
    hit = get("partial_rotary_factor")
    return float(hit[0]) if hit is not None else 1.0


def refuse_ple(get: Getter, where: str) -> None:
    """Qwen4-Exp's PLE layers (``ple_layer_ids``, empty at the class defaults) add per-request states no kind plans:
    their dilated short conv's context and the n-gram embedding's previous tokens (Qwen4ExpTextPLELayer._short_conv
    cache.update_conv_state, Qwen4ExpTextNGramEmbedding)."""
    hit = get("ple_layer_ids")
    if hit is not None and isinstance(hit[0], list) and hit[0]:
        raise NotSupportedByKvcache(where, f"PLE layers {hit[0]}: each keeps two per-request states kvcache does not "
                                           "plan, its dilated short conv's context (ple_conv_kernel_size - 1) x "
                                           "ngram_size tokens and the n-gram embedding's previous tokens "
                                           "(transformers/models/qwen4_exp/modeling_qwen4_exp.py:Qwen4ExpTextPLELayer"
                                           "._short_conv, Qwen4ExpTextNGramEmbedding)", field=hit[1])


def read_facts(get: Getter, where: str, model_type: str, head_dim: int, prefix: str = "") -> QsaFacts | None:
    """The QSA indexer of a Qwen4-Exp text config (None for another model_type): all five fields required
    (transformers sizes the indexer's projection by them); one indexer key head (``_select_tokens`` squeezes it);
    a budget of at least one block; a rotary span inside the indexer head (configuration_qwen4_exp.py
    validate_architecture refuses a wider one). ``prefix``: where the text config sits (a missing field's path)."""
    if model_type not in MODEL_TYPES:
        return None
    refuse_ple(get, where)
    values, sources = {}, []
    for name in FIELDS:
        hit = get(name)
        if hit is None:
            raise InputError(where, f"missing: model_type {model_type}'s attention builds its QSA indexer from "
                                    f"{', '.join(FIELDS)} whatever the config says ({SOURCE}): transformers cannot "
                                    "build the model without them either", field=f"{prefix}{name}")
        if isinstance(hit[0], bool) or not isinstance(hit[0], int) or hit[0] < 1:
            raise InputError(where, f"must be a positive integer, got {hit[0]!r}", field=hit[1])
        values[name] = hit[0]
        sources.append(hit[1])
    at = dict(zip(FIELDS, sources, strict=True))
    if values["indexer_kv_heads"] != 1:
        raise NotSupportedByKvcache(where, f"indexer_kv_heads {values['indexer_kv_heads']}: QSA pools one raw "
                                           f"indexer key per token ({SOURCE}._select_tokens squeezes the key head)",
                                    field=at["indexer_kv_heads"])
    if values["indexer_budget"] < values["indexer_compress_ratio"]:
        raise InputError(where, f"indexer_budget {values['indexer_budget']} is below one block of "
                                f"indexer_compress_ratio {values['indexer_compress_ratio']} tokens: the indexer "
                                "would keep no block (budget // ratio = 0)", field=at["indexer_budget"])
    rope_dim = int(head_dim * _rotary_factor(get))
    if rope_dim > values["indexer_head_dim"] or rope_dim % 2:
        raise InputError(where, f"the rotary span {rope_dim} (head_dim x partial_rotary_factor) must be even and fit "
                                f"the indexer head ({values['indexer_head_dim']}): the indexer rotates its first "
                                "rotary dims (configuration_qwen4_exp.py validate_architecture)",
                         field=at["indexer_head_dim"])
    return QsaFacts(values["indexer_n_heads"], values["indexer_head_dim"], values["indexer_budget"],
                    values["indexer_compress_ratio"], rope_dim, " + ".join(sources))


def entries(qsa: QsaFacts, dtype: str) -> list[CacheSpec]:
    """The two indexer entries of an attention layer (single head, indexer_head_dim wide, in the K/V's dtype)."""
    return [CacheSpec(name=RAW_KEY_CACHE, dim=qsa.head_dim, num_head=1, dtype=dtype),
            CacheSpec(name=BLOCK_KEY_CACHE, dim=qsa.head_dim, num_head=1, dtype=dtype)]


class QsaFormat(GqaFormat):
    name = "qsa"
    fa_call = False  # the sparse FA over the selected blocks' tokens: no FA version, layout or path table
    # Qwen4ExpTextAttention.forward folds its indexer's selection into the mask (attention_mask & selected_token_mask):
    # the selection this format plans (its indexer entries compared by hf_off, the sparse FA over the selected blocks)
    planned_score_terms = frozenset({MASK_REWRITTEN})
    doc_example = ("GQA + QSA 块稀疏注意力(indexer 原始 key 与块 key 缓存)", "Qwen4-Exp",
                   {"model_type": "qwen4_exp_text", "num_key_value_heads": 2, "head_dim": 256,
                    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
                    "indexer_compress_ratio": 4,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}})

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        return super().caches(facts, tp, kv_mode, dtype, decoder_layer) + entries(facts.qsa.value, dtype)

    def hf_facts(self, module) -> dict[str, int | None]:
        """A module holding a QSA indexer (Qwen4ExpTextAttention.indexer: index_qk_proj, compress_ratio): its
        indexer head dim (the width of the plan's two indexer entries)."""
        ix = getattr(module, "indexer", None)
        if not all(hasattr(ix, a) for a in ("index_qk_proj", "compress_ratio", "index_head_dim")):
            return {}
        return {"qsa_indexer_head_dim": int(ix.index_head_dim)}

    def hf_off(self, layer, module_facts: dict[str, int | None], cls: str) -> str | None:
        """Where the layer's QSA entries and the module's own indexer disagree; then GQA's comparison."""
        rest = dict(module_facts)
        held = rest.pop("qsa_indexer_head_dim", None)
        planned = {c.name: c.dim for c in layer.caches if c.name in QSA_CACHES}
        if (held is None) != (not planned) or (held is not None and set(planned.values()) != {held}):
            return (f"QSA indexer: analyzer plans {planned or 'no indexer entries'} vs transformers {cls}.indexer "
                    f"{'index_head_dim ' + str(held) if held is not None else 'None'}")
        return super().hf_off(layer, rest, cls)

    def check_kv_mode(self, kv_mode: str, reason: str, where: str) -> None:
        """QSA is paged by design: its selection reads pooled block keys and the selected tokens through the layer's
        block table (npu_lightning_indexer / npu_sparse_flash_attention take PA_BSND caches)."""
        if kv_mode != "paged":
            raise InputError(where, f"kv mode {kv_mode} ({reason}) for QSA (Qwen4-Exp): its indexer and sparse "
                                    "attention read paged caches through the layer's block table; a contiguous "
                                    "Legacy cache has no path for them (plan it Paged)",
                             field=None if where.startswith("--") else "kv_mode")

    def checkout_refusal(self, m) -> tuple[str, str]:
        # no cann-recipes-infer model folder runs QSA, and the checkout run routes no QSA attention (its host route
        # is the pipeline's, validators/pipeline/host_model.py _qsa_forward)
        return "qsa", (f"QSA attention in the engine ({m.qsa.source}): the checkout run routes no QSA indexer yet "
                       "(validate the render with kvcache validate --rendered)")

    def sections(self, facts: Facts, layers, groups, parallel, dtype: str, block_size: int,
                 max_len: int | None) -> dict:
        return {"qsa": decide(facts, dtype)}

    def decision_rows(self, m) -> list[tuple[str, str, str]]:
        q = m.qsa
        return [("QSA 块稀疏注意力", f"indexer_budget={q.budget}, compress_ratio={q.ratio}(每个 query 选 "
                 f"{q.block_topk} 块 + 未满的尾块), indexer heads {q.n_heads} x {q.head_dim}, 每层 "
                 f"{RAW_KEY_CACHE} 与 {BLOCK_KEY_CACHE}", f"{q.reason}; 选择: {q.selection}")]

    def call_row(self, m) -> tuple[str, str, str]:
        return call_row(m)

    def doc_attention(self, m) -> str:
        return "不用 FA:`npu_lightning_indexer` 选块,`npu_sparse_flash_attention` 只读选中块的 token 与尾块,已渲染"

    def doc_layout(self, m) -> str:
        return "TND(缓存 PA_BSND)"

    def doc_write(self, m) -> str:
        return f"{super().doc_write(m)}(K/V、indexer 原始 key、块 key)"


def decide(facts: Facts, dtype: str | None = None) -> QsaDecision:
    q = facts.qsa.value
    return QsaDecision(
        n_heads=q.n_heads, head_dim=q.head_dim, budget=q.budget, ratio=q.ratio, block_topk=q.block_topk,
        rope_dim=q.rope_dim,
        selection=f"per query: the mean of each complete block of {q.ratio} raw indexer keys, k_layernorm'd and "
                  f"RoPE'd (rotate-half, first {q.rope_dim} dims) at the block's first position, scored by sum_h "
                  f"relu(q_h . k) * {q.head_dim}^-0.5; the top {q.block_topk} blocks' tokens plus the incomplete tail "
                  "block's feed the GQA attention (a block is visible once its last token is)",
        source=f"{q.source} ({SOURCE}._select_tokens; ops: {OP_DOCS})",
        reason=f"every attention layer builds its QSA indexer: dense attention differs from the model past "
               f"{q.budget} tokens; the raw indexer keys and the pooled block keys need entries of their own "
               f"({q.head_dim} x 1 head per token) in the layer's blocks",
    )


def call_row(m) -> tuple[str, str, str]:
    """QSA's attention call, in place of the FA rows."""
    return ("稀疏注意力调用",
            f"{SPARSE_FA.op}, layout_query {SPARSE_FA.layout_query} / layout_kv {SPARSE_FA.layout_kv}, sparse_mode "
            f"{SPARSE_FA.sparse_mode}, 每个 query 读 {m.qsa.block_topk} 块 x {m.qsa.ratio} token + 尾块",
            "QSA attends through the sparse FA over the tokens of the blocks the lightning indexer selects; no FA call")


FORMAT = QsaFormat()
