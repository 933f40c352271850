"""DiffLlama's differential attention, analyzer side: K/V kept as two half-head caches each.

transformers ``DiffLlamaAttention.forward`` caches K/V as usual (``num_key_value_heads`` k, even), then splits V by KV
heads into halves and broadcasts each back to k heads (``value_states1 = [V_0..V_{k/2-1}]`` twice, ``value_states2 =
[V_{k/2}..V_{k-1}]`` twice) and calls the attention interface twice with the same Q and K (GQA: query head i reads KV
head i // g). Query head i (KV head j) thus needs value heads j mod k/2 and j mod k/2 + k/2: its own and the one k/2
away. The concat of both outputs on the last dim is chunked along heads: ``out1 - lambda_full * out2``, a group norm
(RMSNorm over 2 x head_dim, no affine) times ``1 - lambda_init``, then o_proj (the module's math, not the cache's).

The paged FA (npu_fused_infer_attention_score) pairs key head j with value head j, its key and value caches of one
shape and one block table (torch_npu 2.14.0 _op_plugin_docs.py:8116 num_key_value_heads, :8285
"key和value的shape需保证一致"; 2.9.0 :6687, :6856). Planned (zero extra memory): K and V each kept as two caches of k/2 heads, ``k_cache`` /
``v_cache`` the heads < k/2 and ``k_cache_hi`` / ``v_cache_hi`` the rest, in the layer's blocks and table; four FA
calls of h/2 query heads (the low query heads with ``k_cache`` over ``v_cache`` and ``v_cache_hi``, the high ones with
``k_cache_hi`` over both): each call's K and V of one shape, its query / KV head ratio the model's. The framework
contract holds any number of per-layer entries in one manager (cann-recipes-infer executor/core/kv_cache/cache_info.py
``LayerCacheInfo.caches``: CacheEntry per name, ``num_head x dim`` per token), so the four cost what K/V cost. The
alternative, a second value cache with the heads rotated by k/2 and two FA calls of all heads, costs +50 % KV memory.
The attention work is transformers' own (every query head scores its keys twice, once per value half); the four
calls are twice the launches of two full-head calls. Under attention TP a rank holds the same slice of both KV-head halves (and of both query-head halves), so its value
heads k/2 apart meet on it: k a multiple of 2 x attn_tp_size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds.gqa import Facts, GqaFormat
from model_infer_kvcache.analyzer.kinds.invariants import DIFF_CACHES
from model_infer_kvcache.analyzer.manifest import CacheSpec, DifferentialDecision

SOURCE = "transformers/models/diffllama/modeling_diffllama.py:DiffLlamaAttention.forward"
OP_DOCS = "torch_npu-2.14.0 _op_plugin_docs.py:8116, :8285; 2.9.0: :6687, :6856"
MODEL_TYPES = ("diffllama",)
# the four entries: K low / V low / K high / V high halves of the KV heads (analyzer/kinds/invariants.py spells them)
K_LO, V_LO, K_HI, V_HI = DIFF_CACHES
# what marks a transformers module as differential attention (DiffLlamaAttention.__init__)
HF_PARTS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_init", "groupnorm")
HF_FACT = "differential"
Getter = Callable[[str], Any]


@dataclass(frozen=True)
class DiffFacts:
    source: str


def read_facts(get: Getter, where: str, model_type: str, kv_heads: int, kv_source: str) -> DiffFacts | None:
    """The differential attention of a DiffLlama config (None for another model_type): its KV heads must split into
    two halves (DiffLlamaAttention.__init__ refuses an odd count, as the four half caches would)."""
    if model_type not in MODEL_TYPES:
        return None
    if kv_heads % 2:
        raise InputError(where, f"{kv_heads} KV heads: DiffLlama's differential attention splits the value heads into "
                                f"two halves and needs an even count ({SOURCE.rsplit('.', 1)[0]}.__init__)",
                         field=kv_source)
    return DiffFacts(source=f"model_type {model_type} ({SOURCE})")


class DiffFormat(GqaFormat):
    name = "differential"
    doc_example = ("GQA + 差分注意力(K/V 各分两半头缓存,四次 FA)", "DiffLlama",
                   {"model_type": "diffllama", "num_key_value_heads": 8})

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        """K/V of the layer's KV heads as two caches of half the heads each (heads < k/2, then the rest)."""
        half, d = self.kv_heads_per_rank(facts, tp, decoder_layer) // 2, facts.head_dim_at(decoder_layer)
        return [CacheSpec(name=name, dim=d, num_head=half, dtype=dtype) for name in DIFF_CACHES]

    def kv_tp_problems(self, facts: Facts, tp: int) -> list[str]:
        """A rank holds the same slice of both KV-head halves (its value heads are k/2 apart): k / tp even, never a
        replicated head."""
        out = super().kv_tp_problems(facts, tp)
        kv = facts.num_key_value_heads.value
        if tp > 1 and (kv < 2 * tp or kv % (2 * tp)):
            out.append(f"attn_tp_size {tp} with DiffLlama's differential attention over {kv} KV heads: each rank "
                       "holds the same slice of both KV-head halves, so num_key_value_heads must be a multiple of "
                       f"2 x attn_tp_size = {2 * tp}")
        return out

    def hf_facts(self, module) -> dict[str, int | None]:
        """A DiffLlamaAttention-like module (its lambdas and group norm): differential."""
        return {HF_FACT: 1} if all(hasattr(module, a) for a in HF_PARTS) else {}

    def hf_off(self, layer, module_facts: dict[str, int | None], cls: str) -> str | None:
        rest = dict(module_facts)
        held = rest.pop(HF_FACT, None) is not None
        planned = {c.name for c in layer.caches} >= set(DIFF_CACHES)
        if held != planned:
            return (f"differential attention: analyzer plans {'the four half-head caches' if planned else 'plain K/V'}"
                    f" vs transformers {cls} {'with' if held else 'without'} its lambdas and group norm")
        return super().hf_off(layer, rest, cls)

    def check_kv_mode(self, kv_mode: str, reason: str, where: str) -> None:
        """The half-head caches are paged entries of the layer's blocks; the Legacy render keeps one K/V row."""
        if kv_mode != "paged":
            raise InputError(where, f"kv mode {kv_mode} ({reason}) for DiffLlama's differential attention: its four "
                                    "half-head caches and FA calls are rendered paged only (plan it Paged)",
                             field=None if where.startswith("--") else "kv_mode")

    def checkout_refusal(self, m) -> tuple[str, str]:
        return "differential", (f"differential attention in the engine ({m.differential.source}): the checkout run "
                                "routes no differential attention yet (validate the render with kvcache validate "
                                "--rendered)")

    def sections(self, facts: Facts, layers, groups, parallel, dtype: str, block_size: int,
                 max_len: int | None) -> dict:
        return {"differential": decide(facts, parallel)}

    def decision_rows(self, m) -> list[tuple[str, str, str]]:
        d = m.differential
        return [("差分注意力", f"K/V 各分两半头缓存({', '.join(DIFF_CACHES)},每个 {d.half_kv_heads} 头),"
                 f"每层四次 FA(每次 {d.half_q_heads} 个 query 头)", f"{d.reason}; {d.layout}")]

    def doc_attention(self, m) -> str:
        return "FA 四次(query 两半 x value 两半,K/V 各分两半头缓存),已渲染"

    def doc_write(self, m) -> str:
        return f"{super().doc_write(m)}(K/V 各两半)"


def decide(facts: Facts, parallel) -> DifferentialDecision:
    kv, q, tp = parallel.num_kv_heads_per_rank, parallel.num_q_heads_per_rank, parallel.attn_tp_size
    ranks = "" if tp == 1 else (
        f"; attention TP {tp}: rank r holds model KV heads [r x {kv // 2}, (r + 1) x {kv // 2}) and the same slice "
        f"+ {kv * tp // 2} (query heads [r x {q // 2}, (r + 1) x {q // 2}) and the same slice + {q * tp // 2}), "
        "so a port splits q_proj / k_proj / v_proj by those rows (low slice, then high slice), not contiguously; "
        "o_proj's input columns stay a contiguous share (the combined heads are the low ones)")
    return DifferentialDecision(
        half_kv_heads=kv // 2, half_q_heads=q // 2,
        layout=f"{K_LO} / {V_LO}: the rank's KV heads [0, {kv // 2}); {K_HI} / {V_HI}: [{kv // 2}, {kv}); FA calls: "
               f"query heads [0, {q // 2}) with {K_LO} over {V_LO} (value1) and {V_HI} (value2), query heads "
               f"[{q // 2}, {q}) with {K_HI} over {V_LO} (value1) and {V_HI} (value2); the host concatenates value1 "
               f"and value2 outputs on the last dim (transformers' torch.cat([attn_output1, attn_output2], -1)){ranks}",
        memory="the four caches hold K and V once (2 x k/2 heads each): what plain GQA K/V costs; a second value "
               "cache with the heads rotated by k/2 would cost +50 %",
        source=f"{facts.diff.value.source}; ops: npu_fused_infer_attention_score ({OP_DOCS})",
        reason="the module attends twice over one K with V's halves broadcast to every KV head: query head i "
               "(KV head j) reads value heads j mod k/2 and j mod k/2 + k/2, which one FA call (key head j with "
               "value head j, key and value caches of one shape) cannot pair",
    )


FORMAT = DiffFormat()
