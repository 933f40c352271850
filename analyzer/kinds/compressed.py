"""DeepSeek-V4 compressed attention (CSA / HCA): the compressed cache kind, analyzer side.

Every V4 layer attends through a sliding-window branch over its last ``sliding_window`` tokens (one shared K=V
row per token, the layer's ``win_kv``). A compressed layer adds a second branch: every ``m`` tokens of a request
become one compressed entry (CSA: m = 4, and a lightning indexer keeps its own compressed keys and picks
``index_topk`` entries per query; HCA: m = 128, attended whole). The tokens of an unfinished group wait in the
compressor state, a window of ``coff x m`` tokens (CSA's two overlapping series: coff 2; HCA: 1).

Sources of truth: transformers ``deepseek_v4`` (``DeepseekV4Config``, ``DeepseekV4CSACache`` /
``DeepseekV4HCACache``: the oracle); upstream cann-recipes-infer ``models/deepseek_v4``'s ``_init_cache_entries``
(entry names, managers, block sizes, state shapes); ``executor/core/kv_cache/cache_utils`` (how a FullAttention
entry with ``compress_ratio`` r is sized: row bytes // r per token, a block spanning ``block_size = bs x r``
tokens); the AscendC op docs ``ops/ascendc/docs/custom-npu_compressor.md`` and
``custom-npu_sparse_attn_sharedkv.md`` (what the device kernels take). References: references/compressed.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_infer_kvcache.analyzer import kv_cache_spec
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.kinds.gqa import Facts, GqaFormat
from model_infer_kvcache.analyzer.manifest import (
    CacheSpec,
    CompressedAttentionDecision,
    CompressedBranch,
    CompressedEntry,
    Finding,
    LayerPlan,
)

CSA, HCA = "csa", "hca"
WINDOW_ENTRY = "win_kv"  # every layer's window branch: one shared K=V row per token (upstream's name and manager)
# transformers' layer types of the two compressed branches (DEEPSEEK_V4_LAYER_TYPES; 'sliding_attention' is the
# window branch alone, planned as any sliding layer)
LAYER_TYPE_KIND = {"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
KIND_LAYER_TYPE = {kind: name for name, kind in LAYER_TYPE_KIND.items()}
# DeepseekV4Config.default_compress_rates, keyed by branch
DEFAULT_RATES = {CSA: 4, HCA: 128}
# legacy ``compress_ratios`` (one int per layer): transformers' _COMPRESS_RATIO_TO_LAYER_TYPE; 0 (upstream writes 1
# for MTP layers) is the window branch alone
LEGACY_RATIO_KIND = {4: CSA, 128: HCA}
WINDOW_ONLY_RATIOS = (0, 1)
# The ratio each branch runs at on the device: custom.compressor 'supports cmp_ratio 4/128: C4A D=512 coff=2, C4Li
# D=128 coff=2, C128A D=512 coff=1'; npu_sparse_attn_sharedkv 'cmp_ratio 数据范围支持4/128'; upstream builds the
# indexer (CSA) only where compress_ratio == 4. Other rates are planned for a torch path (device_constraints).
DEVICE_RATIO = {CSA: 4, HCA: 128}
# compressed series per token (the compressor's coff): CSA's entry w pools window w-1's Ca with window w's Cb
COFF = {CSA: 2, HCA: 1}
# DeepseekV4Config defaults of the fields a config may leave out
CONFIG_DEFAULTS = {"sliding_window": 128, "index_topk": 512, "index_n_heads": 64, "index_head_dim": 128}
# The fused kernels' fixed shapes (custom-npu_sparse_attn_sharedkv.md, 参数说明 / 约束说明)
OP_HEAD_DIM = 512  # 'q中的D和ori_kv、cmp_kv的D值相等为512'
OP_WINDOW = 128  # 'ori_win_left 仅支持默认值127': the query and the 127 tokens before it
OP_TOPK = 512  # 'cmp_sparse_indices ... K2仅支持512'
OP_Q_HEADS = 64  # 'layout_q为TND时 ... N1仅支持64'
OP_MAX_ROWS_PER_BLOCK = 1024  # 'cmp_block_size取值为16的倍数，最大支持1024'
STATE_DTYPE = "float32"  # upstream sfa_kv_state / li_kv_state: torch.float32 (state + score)
MLA_LATENT = (512, 64)  # DeepSeek-V3's MLA latent per token and layer (kv_lora_rank, qk_rope_head_dim): the figure
OPERATORS = {
    "attention": "custom.npu_sparse_attn_sharedkv (+ _metadata): the window branch and the compressed branch in one "
                 "call (ori_kv = win_kv, cmp_kv = the compressed entries, cmp_sparse_indices = CSA's top-k)",
    "compressor": "custom.compressor: pools each complete group of m tokens into one entry, the unfinished group "
                  "kept in the state cache",
    "indexer": "torch_npu.npu_lightning_indexer (float; one batch row per query over the entries it may see): CSA's "
               "top-k over the indexer's compressed keys (upstream: the int8 custom.npu_quant_lightning_indexer)",
    "write": "custom.scatter_nd_update_asc: the compressed rows into their blocks",
    "rotary": "custom.inplace_partial_rotary_mul: RoPE on the rope_head_dim tail only",
}
_WHERE_DOC = "cann-recipes-infer ops/ascendc/docs/"


@dataclass(frozen=True)
class CompressedFacts:
    """What a DeepSeek-V4 config says about its compressed branches."""

    kinds: tuple[str | None, ...]  # per decoder layer: csa | hca | None (window branch only)
    rates: dict[str, int]  # branch -> m
    window: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    source: str  # the layer kinds and rates
    window_source: str
    index_source: str

    def layers_of(self, kind: str | None) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind]


Getter = Callable[..., "tuple[Any, str] | None"]


def _positive_int(get: Getter, where: str, name: str) -> tuple[int, str]:
    hit = get(name)
    if hit is None:
        return CONFIG_DEFAULTS[name], f"default: DeepseekV4Config.{name} = {CONFIG_DEFAULTS[name]}"
    value, src = hit
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(where, f"must be a positive integer, got {value!r}", field=src)
    return value, src


def read_facts(get: Getter, where: str, num_layers: int) -> CompressedFacts | None:
    """The compressed branches of a config, None when it has none.

    Spellings, first match wins (as ``DeepseekV4Config.__post_init__`` folds them): ``layer_types`` naming
    CSA / HCA with ``compress_rates`` (legacy ``compress_rate_csa`` / ``compress_rate_hca`` override it); else the
    legacy per-layer ``compress_ratios`` (0: window only, 4: CSA, 128: HCA; upstream's own config writes 1 for
    window-only layers and lists the MTP layers after the decoder layers). A ratio the device kernels do not take
    is refused by name, with the op doc that says so.
    """
    types = get("layer_types")
    ratios = get("compress_ratios")
    if types is not None and isinstance(types[0], list) and any(t in LAYER_TYPE_KIND for t in types[0]):
        kinds = tuple(LAYER_TYPE_KIND.get(t) if isinstance(t, str) else None for t in types[0][:num_layers])
        rates, rates_src = _rates(get, where)
        source = f"{types[1]} + {rates_src}"
    elif ratios is not None and isinstance(ratios[0], list) and any(
            isinstance(x, int) and not isinstance(x, bool) and x > 1 for x in ratios[0]):
        raw, src = ratios
        if len(raw) < num_layers:
            raise InputError(where, f"lists {len(raw)} ratios for {num_layers} decoder layers", field=src)
        kinds_list = []
        for i, x in enumerate(raw[:num_layers]):
            if isinstance(x, bool) or not isinstance(x, int) or (x not in LEGACY_RATIO_KIND and x not in
                                                                  WINDOW_ONLY_RATIOS):
                raise InputError(where, f"compress ratio {x!r}: a per-layer ratio names the layer's branch, 4 (CSA) "
                                        "or 128 (HCA), or 0 / 1 for the window branch alone (transformers "
                                        "DeepseekV4Config maps 0 / 4 / 128; upstream deepseek_v4 writes 1); give "
                                        "other rates as layer_types + compress_rates", field=f"{src}[{i}]")
            kinds_list.append(LEGACY_RATIO_KIND.get(x))
        kinds = tuple(kinds_list)
        rates = {kind: ratio for ratio, kind in LEGACY_RATIO_KIND.items()}
        source = f"{src} (0/1: window only, 4: CSA, 128: HCA)"
    else:
        return None
    window, window_src = _positive_int(get, where, "sliding_window")
    topk, topk_src = _positive_int(get, where, "index_topk")
    heads, heads_src = _positive_int(get, where, "index_n_heads")
    dim, dim_src = _positive_int(get, where, "index_head_dim")
    return CompressedFacts(kinds=kinds, rates=rates, window=window, index_topk=topk, index_n_heads=heads,
                           index_head_dim=dim, source=source, window_source=window_src,
                           index_source=f"{topk_src}, {heads_src}, {dim_src}")


def _rates(get: Getter, where: str) -> tuple[dict[str, int], str]:
    """Each branch's m: ``compress_rates`` keyed by layer type, legacy scalars folded in. A rate the device kernels
    do not take (4 for CSA, 128 for HCA) is planned for a torch path and flagged in device_constraints, as CPU
    validation shrinks it to cross group boundaries in short streams."""
    rates = dict(DEFAULT_RATES)
    sources = []
    hit = get("compress_rates")
    if hit is not None:
        value, src = hit
        if not isinstance(value, dict):
            raise InputError(where, f"must be an object of layer type -> rate, got {value!r}", field=src)
        for name, rate in value.items():
            if name not in LAYER_TYPE_KIND:
                raise InputError(where, f"unknown layer type {name!r} (known: {', '.join(LAYER_TYPE_KIND)})",
                                 field=f"{src}.{name}")
            rates[LAYER_TYPE_KIND[name]] = rate
        sources.append(src)
    for kind in (CSA, HCA):
        legacy = get(f"compress_rate_{kind}")
        if legacy is not None:
            rates[kind] = legacy[0]
            sources.append(legacy[1])
    where_rates = sources[-1] if sources else "compress_rates"
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 2:
            raise InputError(where, f"{KIND_LAYER_TYPE[kind]} at compress rate {rate!r}: a rate is an integer >= 2 "
                                    "(tokens pooled into one entry)", field=where_rates)
    if rates[CSA] == rates[HCA]:
        # upstream names the managers c{m}a_cmp_kv / c{m}a_cmp_state: two branches at one m would share a state
        # manager with two windows (coff x m), which the framework refuses
        raise InputError(where, f"CSA and HCA at the same compress rate {rates[CSA]}: their managers "
                                f"(c{rates[CSA]}a_cmp_kv / _cmp_state) would collide", field=where_rates)
    return rates, " + ".join(sources) if sources else "default: DeepseekV4Config.default_compress_rates {csa: 4, hca: 128}"


# ------------------------------------------------------------------------------------------------ cache entries

def branch(facts: CompressedFacts, decoder_layer: int, head_dim: int, dtype: str, block_size: int
           ) -> CompressedBranch | None:
    """One layer's compressed branch and its cache entries, as upstream deepseek_v4 registers them (bf16 path:
    ``kv_cache_quant_mode`` / ``li_cache_quant_mode`` unquantized); None for a window-only layer."""
    kind = facts.kinds[decoder_layer]
    if kind is None:
        return None
    m, coff = facts.rates[kind], COFF[kind]
    compressed_key, state_key = f"c{m}a_cmp_kv", f"c{m}a_cmp_state"
    entries = [CompressedEntry(name="sfa_cmp_kv", role="compressed_kv", dim=[head_dim], num_head=1, dtype=dtype,
                               manager_key=compressed_key, block_size=block_size * m, compress_ratio=m)]
    if kind == CSA:
        entries.append(CompressedEntry(name="li_cmp_kv", role="indexer_kv", dim=[facts.index_head_dim], num_head=1,
                                       dtype=dtype, manager_key=compressed_key, block_size=block_size * m,
                                       compress_ratio=m))
    # the state: per token of the last coff x m, the projected kv and its gate score (num_head 2: state + score)
    entries.append(CompressedEntry(name="sfa_kv_state", role="compressor_state", dim=[coff, head_dim], num_head=2,
                                   dtype=STATE_DTYPE, manager_key=state_key, block_size=block_size,
                                   sliding_window=coff * m))
    if kind == CSA:
        entries.append(CompressedEntry(name="li_kv_state", role="indexer_state", dim=[coff, facts.index_head_dim],
                                       num_head=2, dtype=STATE_DTYPE, manager_key=state_key, block_size=block_size,
                                       sliding_window=coff * m))
    return CompressedBranch(kind=kind, compress_ratio=m, entries=entries,
                            index_topk=facts.index_topk if kind == CSA else None)


def entry_token_bytes(entry: CompressedEntry) -> int:
    """The framework's bytes per token of one entry: ``dims x num_head x itemsize // compress_ratio``."""
    return kv_cache_spec.token_bytes(math.prod(entry.dim), entry.num_head, kv_cache_spec.DTYPE_BYTES[entry.dtype],
                                     entry.compress_ratio)


def branch_kind(layer: LayerPlan) -> str:
    """A layer's compressed branch as one word (csa | hca | none), for the tiny model's layer plans."""
    return layer.compressed.kind if layer.compressed else "none"


# ------------------------------------------------------------------------------------------------ state ring

def state_ring_tokens(window: int, next_n: int) -> int:
    """Tokens of a request's compressor state kept as a ring addressed by position (the standalone runner's slot).

    The compressor reads back only the tokens before the step of the groups it pools (at most ``window - 1`` =
    ``coff x m - 1``) and writes the step's own at ``p % ring``. A speculative verify step (1 + next_n tokens) writes
    past what it keeps: when its drafts are rejected the next step starts again right after its first token (always
    accepted) and re-reads the group under construction, which the last rejected draft, at most ``next_n - 1``
    tokens further, must not have overwritten; so the ring holds ``window + next_n - 1`` (at least ``window``).
    Rejected drafts' own states and any entry one of them completed are rewritten by position before anything
    reads them (upstream: start_pos restarts at the accepted length; references/compressed.md)."""
    return window + max(next_n - 1, 0)


# ------------------------------------------------------------------------------------------------ memory groups

def memory_groups(layers: list[LayerPlan], window_token_bytes: Callable[[LayerPlan], int], mtp_layers: int,
                  next_n: int, block_size: int) -> list[kv_cache_spec.Spec]:
    """The framework's managers of a compressed model, from the planned layers.

    ``win_kv``: every layer's window branch and, when speculative decoding is on, each MTP layer's (upstream sets
    compress_ratio 1 on MTP layers: window branch only, merged into the same manager). Each ``c{m}a_cmp_kv``: a
    growing group of compressed rows (CompressedSpec); each ``c{m}a_cmp_state``: a fixed sliding group of
    ``coff x m`` tokens (the compressor state is a SlidingWindow entry upstream).
    """
    window_layers = [layer for layer in layers if layer.caches]
    per_token = sum(window_token_bytes(layer) for layer in window_layers)
    per_token += mtp_layers * window_token_bytes(window_layers[0]) if window_layers else 0
    groups: list[kv_cache_spec.Spec] = [kv_cache_spec.SlidingWindowSpec(
        window_layers[0].group_key, len(window_layers) + mtp_layers, per_token, block_size,
        window=window_layers[0].sliding_window, next_n=next_n)] if window_layers else []
    by_key: dict[str, list[tuple[LayerPlan, CompressedEntry]]] = {}
    for layer in layers:
        for entry in layer.compressed.entries if layer.compressed else []:
            by_key.setdefault(entry.manager_key, []).append((layer, entry))
    for key in sorted(by_key):
        members = by_key[key]
        first = members[0][1]
        n_layers = len({layer.index for layer, _ in members})
        total = sum(entry_token_bytes(e) for _, e in members)
        if first.sliding_window is not None:
            groups.append(kv_cache_spec.SlidingWindowSpec(key, n_layers, total, first.block_size,
                                                          window=first.sliding_window, next_n=next_n))
        else:
            groups.append(kv_cache_spec.CompressedSpec(key, n_layers, total, first.block_size,
                                                       compress_ratio=first.compress_ratio))
    return groups


# ------------------------------------------------------------------------------------------------ the decision

def check_kv_mode(kv_mode: str, reason: str, where: str) -> None:
    """Compressed attention is paged by design (window blocks, compressed rows, compressor states, each its own
    manager): a Legacy contiguous cache has no compressed kind and no code path that serves it."""
    if kv_mode != "paged":
        raise InputError(where, f"kv mode {kv_mode} ({reason}) for compressed attention (DeepSeek-V4): its window "
                                "branch, compressed rows and compressor states are paged managers of their own; a "
                                "contiguous Legacy cache has no compressed kind (plan it Paged)",
                         field=None if where.startswith("--") else "kv_mode")


def decide(facts: CompressedFacts, layers: list[LayerPlan], groups: list[kv_cache_spec.Spec], q_heads_per_rank: int,
           head_dim: int, dtype: str, block_size: int, mtp_layers: int,
           max_len: int | None) -> CompressedAttentionDecision:
    csa, hca = facts.layers_of(CSA), facts.layers_of(HCA)
    return CompressedAttentionDecision(
        csa_layers=csa,
        hca_layers=hca,
        window_only_layers=facts.layers_of(None),
        compress_rates=dict(sorted(facts.rates.items())),
        sliding_window=facts.window,
        index_topk=facts.index_topk,
        index_n_heads=facts.index_n_heads,
        index_head_dim=facts.index_head_dim,
        mtp_layers=mtp_layers,
        operators=dict(OPERATORS),
        device_constraints=device_constraints(facts, q_heads_per_rank, head_dim, block_size),
        long_context=long_context(groups, len(layers), head_dim, dtype, max_len),
        source=f"{facts.source}; window {facts.window_source}; indexer {facts.index_source}",
        reason=(f"{len(csa)} CSA layer(s) (one entry per {facts.rates[CSA]} tokens, the indexer's top "
                f"{facts.index_topk}), {len(hca)} HCA layer(s) (one entry per {facts.rates[HCA]} tokens, attended "
                f"whole), every layer a {facts.window}-token window branch (win_kv); the unfinished group of each "
                "request waits in its compressor state (a window of coff x m tokens), written as an entry only "
                "once complete" + (f"; {mtp_layers} MTP layer(s) keep the window branch only (upstream: "
                                   "compress_ratio 1 on MTP layers)" if mtp_layers else "")),
    )


def device_constraints(facts: CompressedFacts, q_heads_per_rank: int, head_dim: int, block_size: int) -> list[str]:
    """Each fixed shape of the fused kernels, and whether this plan meets it (a shape that does not is served by a
    torch path, said here, not by the kernel)."""
    doc = f"{_WHERE_DOC}custom-npu_sparse_attn_sharedkv.md"
    rows = [
        (all(facts.rates[k] == DEVICE_RATIO[k] for k in (CSA, HCA)),
         f"compress rates CSA {facts.rates[CSA]} / HCA {facts.rates[HCA]}: the kernels take cmp_ratio 4 (CSA, with "
         f"its indexer) and 128 (HCA) only ({_WHERE_DOC}custom-npu_compressor.md, {doc})"),
        (head_dim == OP_HEAD_DIM, f"head_dim {head_dim}: the kernel takes D = {OP_HEAD_DIM} ({doc})"),
        (facts.window == OP_WINDOW, f"sliding_window {facts.window}: the kernel's window is ori_win_left 127 + the "
                                    f"query = {OP_WINDOW} ({doc})"),
        (facts.index_topk == OP_TOPK or not facts.layers_of(CSA),
         f"index_topk {facts.index_topk}: cmp_sparse_indices K2 = {OP_TOPK} only ({doc})"),
        (q_heads_per_rank == OP_Q_HEADS, f"{q_heads_per_rank} query heads per rank: layout TND takes N1 = "
                                         f"{OP_Q_HEADS} only ({doc})"),
        (block_size % 16 == 0 and block_size <= OP_MAX_ROWS_PER_BLOCK,
         f"block_size {block_size} rows per compressed block: a multiple of 16, at most {OP_MAX_ROWS_PER_BLOCK} "
         f"({doc})"),
    ]
    return [("met: " if ok else "NOT met (torch path, not the fused kernel): ") + text for ok, text in rows]


def long_context(groups: list[kv_cache_spec.Spec], num_layers: int, head_dim: int, dtype: str,
                 max_len: int | None) -> str:
    """One request of ``max_len`` tokens: the bytes the plan's groups hold for it (one rank: each group's blocks per
    request x block bytes, the framework's arithmetic on the specs), beside what the same layers would hold
    uncompressed and what DeepSeek-V3's MLA latent would."""
    if not max_len:
        return "no max_len (no --max-len, no max_position_embeddings): no long-context figure"
    itemsize = kv_cache_spec.DTYPE_BYTES[dtype]
    held = int(sum(g.blocks_per_request(max_len) * g.block_bytes for g in groups))
    dense = num_layers * max_len * head_dim * itemsize
    mla = num_layers * max_len * sum(MLA_LATENT) * itemsize
    gib = 1024 ** 3
    return (f"one request of {max_len} tokens holds {held / gib:.2f} GiB on one rank ({held} B: window blocks, "
            f"compressed blocks rounded up, compressor states, MTP and speculative reservations included); the same "
            f"{num_layers} layers uncompressed ({head_dim} x {itemsize} B per token and layer) would hold "
            f"{dense / gib:.2f} GiB, an MLA latent ({MLA_LATENT[0]} + {MLA_LATENT[1]} per token and layer, "
            f"DeepSeek-V3) {mla / gib:.2f} GiB")


# ------------------------------------------------------------------------------------------------ the format

def _int_attr(module, name: str) -> int | None:
    value = getattr(module, name, None) if module is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class CompressedFormat(GqaFormat):
    """Shared-KV MQA over the window branch (``win_kv``), the compressed branches on each layer's own plan."""

    name = "compressed"
    # no FA call: the window band is npu_sparse_attn_sharedkv's own, fixed by its doc (ori_win_left 127,
    # ori_mask_mode 4, its emulation refuses any other), so FA's band readings are no dependency of the plan
    fa_band = False
    hf_projections = (frozenset({"q_a_proj", "kv_proj", "o_b_proj"}),)  # shared-KV MQA (its compressors: kv_proj only)
    doc_example = ("压缩注意力(窗口分支 + CSA / HCA 压缩分支,references/compressed.md)", "DeepSeek-V4-Flash / Pro",
                   {"model_type": "deepseek_v4", "head_dim": 512, "num_key_value_heads": 1, "q_lora_rank": 1024,
                    "sliding_window": 128, "compress_ratios": [0, 0, 4, 128], "index_topk": 512, "index_n_heads": 64,
                    "index_head_dim": 128, "num_nextn_predict_layers": 1})

    def caches(self, facts: Facts, tp: int, kv_mode: str, dtype: str, decoder_layer: int | None) -> list[CacheSpec]:
        # one K=V row per token for the window branch (upstream win_kv); the compressed branch's entries ride on the
        # layer's own plan (LayerPlan.compressed)
        return [CacheSpec(name=WINDOW_ENTRY, dim=facts.head_dim_at(decoder_layer),
                          num_head=self.kv_heads_per_rank(facts, tp, decoder_layer), dtype=dtype)]

    def layer_fields(self, facts: Facts, decoder_layer: int, dtype: str, block_size: int) -> dict[str, Any]:
        return {"compressed": branch(facts.compressed.value, decoder_layer, facts.head_dim_at(decoder_layer), dtype,
                                     block_size)}

    def group_key(self, attn_type: str, caches: list[CacheSpec]) -> str:
        return caches[0].name  # upstream deepseek_v4 keys its window branch's manager by the entry (win_kv)

    def memory_groups(self, facts: Facts, layers: list[LayerPlan], token_bytes: Callable[[LayerPlan], int],
                      next_n: int, block_size: int) -> tuple[list[kv_cache_spec.Spec], list[str]]:
        mtp = facts.num_mtp_layers.value
        groups = memory_groups(layers, token_bytes, mtp if any(layer.caches for layer in layers) else 0, next_n,
                               block_size)
        return groups, [f"includes {mtp} MTP layer(s) ({facts.num_mtp_layers.source}) in {WINDOW_ENTRY}: window "
                        "branch only (upstream compress_ratio 1 on MTP layers)"] if mtp else []

    def per_token_note(self) -> str:
        return " (// compress_ratio for a compressed entry)"

    def hf_facts(self, module) -> dict[str, int | None]:
        """transformers' DeepseekV4Attention: ``compressor.compress_rate`` and its CSA ``indexer.index_topk``."""
        compressor = getattr(module, "compressor", None)
        if compressor is None:
            return {}
        return {"compress_rate": _int_attr(compressor, "compress_rate"),
                "index_topk": _int_attr(getattr(compressor, "indexer", None), "index_topk")}

    def hf_off(self, layer: LayerPlan, module_facts: dict[str, int | None], cls: str) -> str | None:
        """Where the layer's compressed branch (rate, indexer top-k) differs from the module's compressor."""
        planned = layer.compressed
        rate, got = (planned.compress_ratio if planned else None), module_facts.get("compress_rate")
        if rate != got:
            return (f"compressed branch: analyzer {f'{planned.kind.upper()} at rate {rate}' if planned else 'none (window only)'}"
                    f" vs transformers {f'compress_rate {got}' if got else 'no compressor'} ({cls}.compressor)")
        topk, got = (planned.index_topk if planned else None), module_facts.get("index_topk")
        if topk != got:
            return (f"compressed branch: indexer top-k: analyzer {topk or 'none'} vs transformers "
                    f"{got or 'no indexer'} ({cls}.compressor.indexer.index_topk)")
        return None

    def sections(self, facts: Facts, layers: list[LayerPlan], groups: list[kv_cache_spec.Spec], parallel,
                 dtype: str, block_size: int, max_len: int | None) -> dict[str, Any]:
        return {"compressed": decide(facts.compressed.value, layers, groups, parallel.num_q_heads_per_rank,
                                     facts.head_dim.value, dtype, block_size, facts.num_mtp_layers.value,
                                     max_len or facts.max_position_embeddings.value)}

    def decision_rows(self, m) -> list[tuple[str, str, str]]:
        return decision_rows(m)

    def doc_attention(self, m) -> str:
        return ("不用 FA:`custom.npu_sparse_attn_sharedkv`(窗口分支 + 压缩分支一次调用);窗口、CSA(浮点 "
                "`npu_lightning_indexer` 取 top-k)与 HCA 层 render 并校验(两种部署模式)")

    def doc_layout(self, m) -> str:
        return "TND(缓存 PA_ND)"  # the sparse_attn_sharedkv's layouts

    def doc_write(self, m) -> str:
        return f"{super().doc_write(m)}(win_kv) + `custom.compressor`(压缩行)"

    def check_kv_mode(self, kv_mode: str, reason: str, where: str) -> None:
        check_kv_mode(kv_mode, reason, where)

    def checkout_refusal(self, m) -> tuple[str, str]:
        # planned (analyze), not driven: the folder's int8 indexer path quantizes with torch_npu.npu_dynamic_quant
        # and its compressor has a quant_compressor variant, neither emulated on CPU, and the run has no oracle for a
        # compressed branch yet (issue 38); a run would fail inside them, not the model
        c = m.compressed
        return "compressed", (f"DeepSeek-V4 compressed attention in the engine ({len(c.csa_layers)} CSA, "
                              f"{len(c.hca_layers)} HCA layer(s), {c.source}): the checkout run does not emulate "
                              "torch_npu.npu_dynamic_quant (its int8 indexer path) or custom.quant_compressor, and "
                              "compares no compressed branch yet")

    def notes(self, facts: Facts) -> tuple[list[Finding], list[Finding]]:
        return [Finding(message="fa.* describes no kernel of this model: every layer attends through "
                                "custom.npu_sparse_attn_sharedkv (window and compressed branches in one call; "
                                "compressed.operators)", fields=[facts.compressed.source])], []


FORMAT = CompressedFormat()


# ------------------------------------------------------------------------------------------------ progress.md rows

def decision_rows(m) -> list[tuple[str, str, str]]:
    """The compressed kind's rows of the decisions table (analyzer/decisions_table.py): the branches per layer, the
    entries each branch registers, the device constraints and the long-context figure."""
    c = m.compressed
    entries: dict[str, str] = {}
    for layer in m.layers:
        for e in layer.compressed.entries if layer.compressed else []:
            entries.setdefault(e.name + e.manager_key, f"{e.name} {e.dim}x{e.num_head} {e.dtype} ({e.manager_key}, "
                                                       f"block {e.block_size} token" +
                                                       (f", ratio {e.compress_ratio}" if e.compress_ratio > 1 else
                                                        f", window {e.sliding_window}") + ")")
    unmet = [x for x in c.device_constraints if not x.startswith("met: ")]
    return [
        ("压缩注意力 (CSA / HCA)", f"CSA {len(c.csa_layers)} 层 (m={c.compress_rates[CSA]}, top-{c.index_topk}), "
                                f"HCA {len(c.hca_layers)} 层 (m={c.compress_rates[HCA]}), 仅窗口 "
                                f"{len(c.window_only_layers)} 层; 窗口 {c.sliding_window} (win_kv)",
         f"{c.reason}; {c.source}"),
        ("压缩分支 cache_entries", "; ".join(entries.values()) or "-", c.operators["attention"]),
        ("压缩算子设备约束", "全部满足" if not unmet else f"{len(unmet)} 项不满足(走 torch 路径)",
         "; ".join(unmet or c.device_constraints)),
        ("长上下文", c.long_context.split(" (")[0], c.long_context),
    ]
