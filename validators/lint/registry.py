"""The linter's rule book: one registry of stable rule IDs (documented in references/errors.md).

Each rule has a fixed ID, a short title, a message template, a fix hint and a severity. The
message templates take ``str.format`` fields filled by the check that fires. IDs never change
meaning; a retired rule keeps its number reserved. The docs list every ID (a test checks it).

Numbering: KV1xx argument names, KV2xx sparse_mode and masks, KV3xx block_table/slot_mapping
dicts, KV4xx kv_len ownership, KV5xx head counts, KV6xx writer arguments, KV7xx packed layout,
KV8xx checks against a selection manifest (``--manifest``), KV90x a standalone runner's slots, caches and
lengths, KV95x graph-mode (captured) decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    title: str
    message: str
    hint: str
    severity: str = "error"
    needs_manifest: bool = False
    deploy: str | None = None  # "framework" / "standalone": silent on files of the other mode


# No ``deploy``: the rule holds in either mode. Operator arguments, sparse modes, masks, MLA head counts and
# writer arguments (KV1xx, KV2xx, KV502/503, KV601) are the operator's contract; kv_len is the runner's in both
# modes, framework or standalone (KV401); KV801-807 and KV811/812 compare the code with the manifest's choices
# whoever owns the cache.
_RULES = (
    # ---------------------------------------------------------------- argument names
    Rule(
        "KV101", "v1-name-on-v2",
        "FA v1 argument name on an FA v2 call",
        "`{kw}=` is the FA v1 name; npu_fused_infer_attention_score_v2 does not read it and "
        "silently uses its default ({default})",
        "rename it to `{fix}=`",
    ),
    Rule(
        "KV102", "v2-name-on-v1",
        "FA v2 argument name on an FA v1 call",
        "`{kw}=` is the FA v2 name; npu_fused_infer_attention_score does not read it and "
        "silently uses its default ({default})",
        "rename it to `{fix}=`",
    ),
    Rule(
        "KV103", "unknown-op-keyword",
        "keyword the real operator schema does not have",
        "`{kw}=` is not an argument of torch_npu.{op} in torch_npu {release} ({why})",
        "{fix}",
    ),
    # ---------------------------------------------------------------- sparse_mode and masks
    Rule(
        "KV201", "prefill-no-causal-mask",
        "prefill FA call with sparse_mode 0 and no mask",
        "prefill FA call runs with sparse_mode={mode} and no atten_mask: no causal masking, "
        "garbage output without any error",
        "pass sparse_mode=3 with the 2048x2048 bool causal mask "
        "(get_init_attn_mask(2048, device))",
    ),
    Rule(
        "KV202", "sliding-sparse-mode-0",
        "sliding-window layer FA call with sparse_mode 0",
        "sliding-window layer FA call uses sparse_mode=0: no band is applied, the query sees keys "
        "outside the window on long sequences",
        "keep sparse_mode=4 with pre_tokens from the window and next_tokens=0 on prefill and decode",
    ),
    Rule(
        "KV203", "mla-decode-sparse-mode-3",
        "MLA absorb decode with sparse_mode 3",
        "MLA absorb decode FA call uses sparse_mode=3: outside the op docs' supported combinations at q_len 1 "
        "(device question mla_decode_sparse_mode3: reported to deviate)",
        "use sparse_mode=0 and atten_mask=None on the MLA absorb decode path (q_len 1)",
    ),
    Rule(
        "KV204", "float-attention-mask",
        "floating-point attention mask",
        "atten_mask is {dtype}: the FA operator accepts only bool/int8/uint8 masks (error on NPU)",
        "build the mask as bool (e.g. `~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))`) "
        "or call `.to(torch.bool)`",
    ),
    Rule(
        "KV205", "mask-shape-not-2048",
        "compressed mask shape other than 2048x2048 for sparse_mode 2/3/4",
        "atten_mask has shape {shape} with sparse_mode={mode}: modes 2/3/4 need the compressed "
        "(2048, 2048) mask (error on NPU)",
        "use get_init_attn_mask(2048, device): the size is fixed, not max_position_embeddings",
    ),
    Rule(
        "KV206", "dsa-not-causal",
        "DSA indexer / sparse attention call with sparse_mode other than 3",
        "{op} runs with sparse_mode={mode}: without rightDownCausal (3) a prefill query selects or attends keys "
        "after its own position, and nothing fails",
        "pass sparse_mode=3 (the default) on npu_lightning_indexer and npu_sparse_flash_attention",
    ),
    # ---------------------------------------------------------------- index dicts
    Rule(
        "KV301", "block-table-dict-whole",
        "block_table dict passed whole",
        "`{expr}` is the framework's dict of block tables (one per attn_type / manager_key), "
        "passed whole to {op}",
        "index it with the layer's key: `block_table[self.attn_type]` "
        "(G2: the entry's manager_key when set)",
        # The per-group dict is the executor's ForwardMetaData; a standalone runner builds one table tensor.
        deploy="framework",
    ),
    Rule(
        "KV302", "slot-mapping-dict-whole",
        "slot_mapping dict passed whole",
        "`{expr}` is the framework's dict of slot mappings (one per attn_type / manager_key), "
        "passed whole to {op}",
        "index it with the layer's key: `slot_mapping[self.attn_type]` "
        "(G2: the entry's manager_key when set)",
        deploy="framework",  # as KV301
    ),
    # ---------------------------------------------------------------- kv_len
    Rule(
        "KV401", "kv-len-mutated",
        "kv_len mutated inside model code",
        "`{expr}` changes kv_len inside {where}: every later layer writes and reads at a "
        "shifted position (silent corruption)",
        "kv_len belongs to the runner: compute it once per step, read it in every layer, "
        "increment it after the forward; use a new local (e.g. `kv_len + 1` inline) for derived lengths",
    ),
    # ---------------------------------------------------------------- head counts
    Rule(
        "KV501", "cache-num-head-unsplit",
        "CacheEntry num_head from the un-split KV head count",
        "CacheEntry num_head=`{expr}` is the model's total KV head count, not the per-rank count: "
        "cache shape mismatch once attention TP > 1",
        "use `max(config.num_key_value_heads // attn_tp_size, 1)` (num_key_value_heads_per_rank)",
        deploy="framework",  # CacheEntry is the framework's registration; a runner sizes its own tensors
    ),
    Rule(
        "KV502", "mla-kv-heads-not-1",
        "MLA absorb FA call with num_key_value_heads other than 1",
        "MLA absorb FA call (key = value = latent cache) {what}: the latent cache has exactly one KV head "
        "(GQA ratio error)",
        "pass num_key_value_heads=1 on MLA absorb calls",
    ),
    Rule(
        "KV503", "dsa-absorb-key-not-value",
        "MLA absorb sparse attention with key and value from different tensors",
        "npu_sparse_flash_attention with attention_mode=2 (MLA absorb) takes key `{key}` and value `{value}`: "
        "absorb attends over one latent cache, key and value are the same tensor",
        "pass the latent (nope) cache as both key and value; the rope part goes in key_rope",
    ),
    # ---------------------------------------------------------------- writers
    Rule(
        "KV601", "rmsnorm-rope-cache-epsilon",
        "hard-coded epsilon in npu_kv_rmsnorm_rope_cache",
        "{op} {what}: it drifts from the model's RMSNorm epsilon",
        "pass the norm module's epsilon, e.g. `epsilon=self.kv_a_layernorm.variance_epsilon`",
    ),
    # ---------------------------------------------------------------- packed layout
    Rule(
        "KV701", "hidden-states-3d-view",
        "hidden states reshaped to [B, S, H] in framework-mode forward code",
        "`{expr}` reshapes packed hidden states to 3-D [batch, seq, hidden]: framework mode "
        "packs variable-length requests as [TotalTokens, hidden]",
        "keep hidden states 2-D [TotalTokens, hidden] and take lengths from forward_metadata",
        # The framework packs the batch; a standalone runner owns its layout and may keep [B, S, H].
        deploy="framework",
    ),
    # ---------------------------------------------------------------- against the manifest
    Rule(
        "KV801", "scale-missing-yarn-mscale",
        "softmax scale without the YaRN mscale² factor",
        "the FA scale `{expr}` has no YaRN factor, but the manifest's model uses YaRN with "
        "mscale_all_dim (scale = {expected:.6g}): silently low scale",
        "multiply the base scale by mscale*mscale, mscale = 0.1*mscale_all_dim*ln(factor)+1 "
        "(manifest fa.scale_derivation)",
        needs_manifest=True,
    ),
    Rule(
        "KV802", "scale-differs-from-manifest",
        "literal softmax scale different from the manifest",
        "the FA scale is {value}, the manifest says {expected:.6g}",
        "derive the scale as in the manifest's fa.scale_derivation",
        needs_manifest=True,
    ),
    Rule(
        "KV803", "fa-version-differs",
        "FA version different from the manifest",
        "call to {op} but the manifest selects FA {expected}",
        "call {fix} (and use its argument names)",
        needs_manifest=True,
    ),
    Rule(
        "KV804", "input-layout-differs",
        "FA input_layout different from the manifest",
        "input_layout={value!r} but the manifest selects {expected!r}",
        "pass input_layout={expected!r}",
        needs_manifest=True,
    ),
    Rule(
        "KV805", "sparse-mode-differs",
        "sparse_mode different from the manifest",
        "{path} FA call uses sparse_mode={value} but the manifest allows {expected} there",
        "use the manifest's sparse_mode for this path (layers[].sparse_mode)",
        needs_manifest=True,
    ),
    Rule(
        "KV806", "pre-tokens-differs",
        "pre_tokens different from the manifest",
        "sliding-window FA call passes pre_tokens={value} but the manifest says {expected}",
        "pass pre_tokens as in the manifest (layers[].pre_tokens; see window_derivation)",
        needs_manifest=True,
    ),
    Rule(
        "KV807", "block-size-differs",
        "block_size different from the manifest",
        "block_size={value} but the manifest's block_size is {expected}",
        "use the manifest's block_size (one value for the whole model)",
        needs_manifest=True,
    ),
    Rule(
        "KV808", "block-size-field-generation",
        "block-size field missing or misplaced for the framework generation",
        "{what} (framework API {gen})",
        "{fix}",
        needs_manifest=True,
        deploy="framework",  # CacheEntry / ModelCacheInfo fields of a framework generation
    ),
    Rule(
        "KV809", "mla-backend-flag",
        "is_mla_backend missing or misplaced for the framework generation",
        "{what} (framework API {gen})",
        "{fix}",
        needs_manifest=True,
        deploy="framework",  # a ModelCacheInfo / CacheEntry field of a framework generation
    ),
    Rule(
        "KV810", "constant-attn-type-mixed-model",
        "constant attn_type in a mixed-attention model",
        "attn_type is always {value!r} in this file, but the manifest's model mixes {expected}: "
        "every layer lands in one manager with the wrong window",
        f"set attn_type per layer in __init__ (e.g. {SLIDING_WINDOW!r} if the layer is sliding "
        f"else {FULL_ATTENTION!r})",
        needs_manifest=True,
        deploy="framework",  # attn_type keys the framework's cache managers
    ),
)

_RULES += (
    Rule(
        "KV811", "mtp-decode-no-verify-case",
        "decode FA call without a q_len > 1 (MTP verify) case",
        "the manifest's model has {layers} MTP layer(s): a speculative-decode verify step carries 1 + next_n "
        "query tokens per request, but this decode FA call always uses sparse_mode={value} (the first "
        "tokens see the drafts after them)",
        "branch on the query length (tokens > requests): q_len > 1 -> sparse_mode={expected} with the "
        "2048x2048 causal mask; q_len 1 keeps sparse_mode={value}",
        needs_manifest=True,
    ),
)

_RULES += (
    Rule(
        "KV812", "indexer-topk-not-manifest",
        "lightning indexer sparse_count different from the manifest's index_topk",
        "npu_lightning_indexer keeps sparse_count={value} keys per query; the manifest's model selects "
        "index_topk={expected}: every sequence longer than that attends to other keys than the model",
        "pass sparse_count=index_topk (the config's value, not a literal of another model)",
        needs_manifest=True,
    ),
)

# ---------------------------------------------------------------- a standalone runner's own lifecycle
# The framework frees slots, allocates the cache once and derives every length from one place; a standalone
# runner does all of it itself, so these are its contract (silent on framework files).
_RULES += (
    Rule(
        "KV902", "slot-length-not-reset",
        "recycled slot whose per-slot length is never reset",
        "`{pool}` hands out slots that are given back and reused, but `{length}` is only ever advanced "
        "(`{grow}`, line {line}) and never reset: a request admitted into a reused slot starts at the previous "
        "request's length and attends over its stale keys",
        "reset the slot's length where the slot is handed out or given back (e.g. `{length}[slot] = 0`, or the "
        "prompt length at prefill)",
        deploy="standalone",
    ),
    Rule(
        "KV903", "cache-allocated-per-step",
        "KV cache allocated inside a per-step function",
        "`{expr}` allocates the KV cache in {where}, which {why}: every step starts from a new, empty cache and "
        "the keys and values of the earlier tokens are lost",
        "allocate the cache once (in __init__ / an init_cache method, or behind `if self.kv_cache is None:`) "
        "and only write into it per step",
        deploy="standalone",
    ),
    Rule(
        "KV904", "host-lengths-other-counter",
        "host-side sequence lengths from another counter than the slot mapping",
        "`{length_kw}=` comes from the host-side `{length_src}` while `{slot_kw}=` comes from `{slot_src}`: two "
        "counters kept in step by hand; once one is updated without the other, attention reads another number "
        "of keys than the writer stored",
        "derive both from one counter (e.g. `kv_lens = self.kv_len[rows] + 1` and "
        "`slot_mapping = offset[rows] + self.kv_len[rows]`; `.tolist()` that tensor if a host list is needed)",
        deploy="standalone",
    ),
)

# Graph-mode decode (KV95x): code the file itself places in a captured decode branch (graph_checks.py). Either
# deployment mode: the framework's engine and a standalone runner capture the same way.
_RULES += (
    Rule(
        "KV951", "host-read-in-graph-decode",
        "device value read back on the host in graph-mode decode",
        "`{expr}.{method}()` in a graph-mode decode branch: a captured step cannot stop to read a device value back "
        "(the capture breaks, or keeps the first step's value and replays it)",
        "take the value as a host list the engine fills before the step (actual_seq_lengths_list_kv, "
        "actual_seq_lengths_cu_list_q) or keep it on the device",
    ),
    Rule(
        "KV952", "tensor-from-host-in-graph-decode",
        "tensor built from host values in graph-mode decode",
        "`torch.{fn}({expr})` in a graph-mode decode branch: the device graph copies the host values once, at "
        "capture, and every replay uses them",
        "compute it on the device from the step's tensors (kv_len, slot_mapping) or build it before the step, "
        "outside the captured forward",
    ),
    Rule(
        "KV953", "tensor-lengths-in-graph-decode",
        "FA lengths given as device tensors in graph-mode decode",
        "`{kw}=` of {op} takes host ints (SymInt[]) and gets the metadata tensor `{field}` in a graph-mode decode "
        "branch: it is read back on the host inside the captured step",
        "pass the host list the engine fills for graph decode (actual_seq_lengths_list_kv, "
        "actual_seq_lengths_cu_list_q)",
    ),
    Rule(
        "KV954", "tensor-branch-in-graph-decode",
        "Python branch on a device value in graph-mode decode",
        "`{expr}` decides a Python `{stmt}` in a graph-mode decode branch: the capture reads the value back and "
        "keeps the branch it took (a recapture when it changes, or one branch replayed for every step)",
        "compute both ways on the device and select with torch.where, or decide it before the step from host values",
    ),
)

RULES: dict[str, Rule] = {rule.id: rule for rule in _RULES}


def rule_ids() -> list[str]:
    return list(RULES)


def parse_id_list(text: str | None) -> set[str]:
    """Split a comma-separated ID list; raises ValueError naming any unknown ID."""
    if not text:
        return set()
    ids = {part.strip().upper() for part in text.split(",") if part.strip()}
    unknown = sorted(ids - RULES.keys())
    if unknown:
        raise ValueError(f"unknown rule ID(s): {', '.join(unknown)} (known: {', '.join(RULES)})")
    return ids
