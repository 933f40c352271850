"""A drafter over its target model's cache, analyzer side (Gemma-4 assistants: transformers'
``Gemma4AssistantForCausalLM`` / ``Gemma4UnifiedAssistantForCausalLM``).

Their configs set ``num_kv_shared_layers = num_hidden_layers`` (``Gemma4*AssistantConfig.__post_init__``): no layer
computes or caches K/V. Every layer attends over ``shared_kv_states[layer_type]``, the K/V the target model's last
"store" layer of that type computed (``Gemma4*TextModel``: the last non-shared full-attention and sliding layer).
On the device the drafter reads those two layers' paged cache blocks through the target's block table (no copy) and
plans no blocks of its own.

The masks (``Gemma4*AssistantForCausalLM.create_attention_masks``): the drafted queries attend over the target's
K/V only, never over each other. Full layers: ``create_bidirectional_mask`` (every query sees every target
position). Sliding layers: ``create_bidirectional_sliding_window_mask`` (``|q - kv| <= W``,
``masking_utils.sliding_window_bidirectional_overlay``) flipped on the kv axis, so drafted query ``q`` of a block
over ``P`` target positions sees keys ``[P - 1 - q - W, P - 1]``. That window widens with ``q``: no FA band
(``i' - pre_tokens <= j <= i' + next_tokens``) reads it for the queries in their order, but it is the band of the
queries in reverse order (query ``T - 1 - q`` on the band's diagonal ``P - T + (T - 1 - q)``: ``pre_tokens`` covers
W + 1 keys, ``next_tokens`` the rest of the prefix), so the render reverses each request's queries around one band
call (sparse_mode 4: "band场景, 即计算pre_tockens和next_tockens之间的部分, 参数起点为右下角", torch_npu 2.14.0
_op_plugin_docs.py, npu_fused_infer_attention_score) and reverses the output back. Exact: each query's softmax is its own. Valid for blocks of at
most W + 1 drafted tokens (past that the flipped window would leave out the newest keys of the later queries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX

# transformers' shared_kv_states key of each attn_type the drafter reads (Gemma4*TextModel: layer_types' names)
SHARED_KV_KEYS = {FULL_ATTENTION: "full_attention", SLIDING_WINDOW: "sliding_attention"}
SOURCE = ("transformers' Gemma4AssistantForCausalLM / Gemma4UnifiedAssistantForCausalLM (forward takes "
          "shared_kv_states: the target's K/V of its last full and sliding layer; create_attention_masks)")


@dataclass(frozen=True)
class DrafterFacts:
    """A config whose every layer reads K/V computed elsewhere: the width of its inputs (None: not in the config)."""

    input_width: int  # inputs_embeds: the target's embedding and last hidden state, 2 x backbone_hidden_size
    source: str


# config layer kinds a drafter's layer may be (transformers' shared_kv_states holds one K/V per layer_types name)
DRAFTER_LAYER_KINDS = ("full", "sliding")


def read_facts(get: Callable[..., tuple[Any, str] | None], shared: tuple[int, str], num_layers: int,
               kinds: tuple[str, ...], where: str) -> DrafterFacts | None:
    """``shared``: (num_kv_shared_layers, its field). A drafter when it shares every layer and names its target's
    width (``backbone_hidden_size``: the assistant configs' own field, the target whose K/V it reads); else None.
    Every layer shared without a target is refused: no model of its own computes the K/V it would read."""
    if shared[0] != num_layers:
        return None
    backbone = get("backbone_hidden_size")
    if not (backbone and isinstance(backbone[0], int) and not isinstance(backbone[0], bool) and backbone[0] > 0):
        raise NotSupportedByKvcache(
            where, f"all {num_layers} layers share K/V computed elsewhere and the config names no target model "
                   "(no backbone_hidden_size, the field of transformers' Gemma4AssistantConfig / "
                   "Gemma4UnifiedAssistantConfig whose forward takes the target's shared_kv_states): no layer "
                   "computes the K/V it would read", field=shared[1])
    other = sorted(set(kinds) - set(DRAFTER_LAYER_KINDS))
    if other:
        raise NotSupportedByKvcache(where, f"a drafter (every layer reads its target's K/V) with {', '.join(other)} "
                                           "layers: kvcache reads a target's full and sliding layers only "
                                           f"({SOURCE})", field=shared[1])
    return DrafterFacts(2 * backbone[0], f"{shared[1]} = {shared[0]} = the number of layers and {backbone[1]} = "
                                         f"{backbone[0]} (the target's width): every layer reads the K/V its target "
                                         f"model computed ({SOURCE})")


def window_tokens(window: int, reading: str) -> tuple[int, int, str]:
    """(pre_tokens, next_tokens, derivation) of the reversed-query band that reads a sliding layer's flipped window.

    transformers' flipped window shows drafted query 0 the last W + 1 target keys (``|q - kv| <= W``, inclusive):
    under the band rule ``i' - pre_tokens <= j`` (reading 'exclusive') pre_tokens = W, counting the query's own
    diagonal (reading 'inclusive') W + 1; next_tokens reaches the end of the prefix."""
    pre = window + 1 if reading == "inclusive" else window
    return pre, INT32_MAX, (f"drafter sliding layer: transformers' bidirectional window (|q - kv| <= W = {window}, "
                            "masking_utils.sliding_window_bidirectional_overlay) flipped on the kv axis shows drafted "
                            f"query q the keys [P-1-q-W, P-1]; the queries reversed make that a band: pre_tokens = "
                            f"{pre} (W + 1 keys on the diagonal, reading {reading!r}), next_tokens = INT32_MAX")


def layer_fields(window: int | None, reading: str) -> dict[str, Any]:
    """A drafter layer's FA fields: no cache, the target layer it reads, and its band (full: no mask at all)."""
    out: dict[str, Any] = dict(caches=[], reads_target=True)
    if window is None:
        out.update(sparse_mode={"prefill": 0, "decode": 0}, mask={"prefill": "none", "decode": "none"},
                   pre_tokens=INT32_MAX, next_tokens=INT32_MAX)  # create_bidirectional_mask: every query sees all
        return out
    pre, nxt, why = window_tokens(window, reading)
    out.update(sparse_mode={"prefill": 4, "decode": 4}, mask={"prefill": "causal_2048", "decode": "causal_2048"},
               pre_tokens=pre, next_tokens=nxt, window_derivation=why)
    return out


def decide(facts, layers: list) -> dict[str, Any] | None:
    """The manifest's ``drafter`` section (None: not a drafter)."""
    d = facts.drafter.value
    if d is None:
        return None
    types = sorted({layer.attn_type for layer in layers}, key=list(SHARED_KV_KEYS).index)
    return dict(
        target_layers={t: f"the target model's last {SHARED_KV_KEYS[t]} layer that computes its own K/V "
                          f"(transformers shared_kv_states[{SHARED_KV_KEYS[t]!r}]): its cache entries and its "
                          f"block_table[{t!r}] row" for t in types},
        shared_kv_keys={t: SHARED_KV_KEYS[t] for t in types},
        input_width=d.input_width,
        blocks=0,
        fa=("full layers: one FA call over the target layer's paged cache, sparse_mode 0 and no atten_mask, "
            "actual_seq_lengths_kv = the target's prefix length; sliding layers: each request's drafted queries "
            "reversed, one band call (sparse_mode 4, pre_tokens / next_tokens of the layer), the output reversed back "
            "(a block of at most sliding_window + 1 drafted tokens)"),
        source=d.source,
        reason=(f"every one of the {len(layers)} layers reads the K/V its target model computed (no k_proj / v_proj, "
                "no cache of its own): on the device the drafter reads the target's paged cache blocks of those "
                "layers through the target's block table, no copy, and plans no blocks of its own"),
    )


def memory_note(section: dict[str, Any]) -> str:
    keys = section["shared_kv_keys"]
    return (f"drafter: 0 blocks of its own (0 B per token): its {len(keys)} attn_type(s) read the target model's "
            "cache (" + "; ".join(f"{t}: the target's last {k} layer" for t, k in keys.items())
            + "), counted in the target's memory plan")


def decision_row(m) -> tuple[str, str, str]:
    """progress.md's row of a drafter manifest: what it reads, that it plans no blocks, how its FA calls read."""
    d = m.drafter
    return ("草稿模型(drafter)", "读目标模型的 cache: " + "; ".join(f"{t} <- 目标最后一个 {k} 层" for t, k in
                                                              d.shared_kv_keys.items()) + "; 自身 0 block",
            f"{d.reason}; {d.fa}")


def problems(m) -> list[tuple[str, str]]:
    """The layers that read the target's cache are exactly the drafter's (all of them), each without a cache."""
    d = getattr(m, "drafter", None)
    for i, layer in enumerate(m.layers):
        reads = bool(getattr(layer, "reads_target", None))
        if reads != (d is not None):
            return [(f"layers[{i}].reads_target", f"{reads} but the manifest has "
                                                  + ("a drafter section" if d else "no drafter section"))]
        if reads and layer.caches:
            return [(f"layers[{i}].caches", f"{len(layer.caches)} entries on a drafter layer: it reads the target "
                                            "model's cache and holds none")]
        if reads and layer.attn_type not in d.target_layers:
            return [(f"layers[{i}].attn_type", f"{layer.attn_type}: drafter.target_layers names no target layer "
                                               "for it")]
        if reads and layer.next_tokens != INT32_MAX:
            return [(f"layers[{i}].next_tokens", f"{layer.next_tokens}: a drafted query sees the target's keys past "
                                                 f"its band diagonal, next_tokens must be {INT32_MAX}")]
        band = (layer.sliding_window, layer.sliding_window + 1) if layer.sliding_window else (INT32_MAX,)
        if reads and layer.pre_tokens not in band:
            return [(f"layers[{i}].pre_tokens", f"{layer.pre_tokens} is not the flipped window's "
                                                f"{' or '.join(map(str, band))} (window {layer.sliding_window})")]
    return []
