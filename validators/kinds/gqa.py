"""GQA / MHA / MQA: K/V caches per KV head, attended by FA calls (V209)."""

from __future__ import annotations

import torch
from model_infer_kvcache.validators.kinds.sharding import keep_rows, kv_head_of_rank
from model_infer_kvcache.validators.pipeline.fa_args import check_fa_calls, check_fa_calls_before_failure

# a tiny model's hidden size may be set to heads x head_dim (the retry of a model that ties them)
HIDDEN_CAN_TIE_TO_HEADS = True


def tiny_attention_fields(d: dict, manifest, *, head_dim_from_hidden: bool) -> None:
    """The tiny config's attention shape, in place: the real head_dim (unless the family derives it from the
    hidden size) and the real KV head count."""
    if not head_dim_from_hidden:
        d["head_dim"] = manifest.model.head_dim
    d["num_key_value_heads"] = manifest.model.num_key_value_heads


def cpu_narrowed(manifest) -> dict[str, dict]:
    """Manifest sections to narrow so CPU prompts exercise the kind (section -> fields): none here."""
    return {}


def cpu_size_changes(manifest, small) -> list[str]:
    """What ``cpu_narrowed`` changed, for a report note."""
    return []


# KV heads per rank a CPU run keeps of a tiny model whose hidden size ties to heads x head_dim (tiny_model.cpu_sized):
# two, so a render that mixes up its KV heads on a rank (or their query groups) still shows
CPU_KV_HEADS_PER_RANK = 2


def cpu_heads(manifest) -> tuple[int, int] | None:
    """(query heads, KV heads), all ranks, for a CPU run with fewer heads (None: keep them): what the checks read
    stays, only the head count falls. head_dim (so the scale, the rotary split, the FA rows), the attention TP, the
    query/KV group ratio (FA: num_heads a multiple of num_key_value_heads, at most 64 times: op docs
    npu_fused_infer_attention_score; MHA stays MHA, GQA keeps its group) and at least ``CPU_KV_HEADS_PER_RANK`` KV
    heads per rank (or all of them when fewer). Not shrunk: replicated KV heads (fewer than ranks: the query heads
    per rank are all the group), a layer with its own shape (Gemma-4's global layers: a second head field per
    layer), an encoder-decoder's (its encoder's heads share the field; Mllama's cross-only blocks use the text model's
    heads and shrink with them: validators/kinds/cross.cpu_section)."""
    m, p = manifest.model, manifest.parallel
    tp = p.attn_tp_size
    if (m.num_key_value_heads < tp or m.num_key_value_heads % tp or m.num_attention_heads % m.num_key_value_heads
            or (manifest.cross_attention is not None and manifest.cross_attention.self_attention)
            or layer_shapes(manifest)):
        return None
    kv = min(p.num_kv_heads_per_rank, CPU_KV_HEADS_PER_RANK) * tp
    if kv >= m.num_key_value_heads:
        return None
    return m.num_attention_heads // m.num_key_value_heads * kv, kv


def layer_shapes(manifest) -> dict[int, tuple[int, int]]:
    """Layer -> (head_dim, KV heads per rank) of each layer whose shape differs from the model's (the render's
    LAYER_SHAPES)."""
    return {layer.index: (layer.head_dim or manifest.model.head_dim,
                          layer.num_kv_heads_per_rank or manifest.parallel.num_kv_heads_per_rank)
            for layer in manifest.attention_layers
            if layer.head_dim is not None or layer.num_kv_heads_per_rank is not None}


def expected_constants(manifest) -> dict[str, object]:
    want = {"NUM_KV_HEADS_PER_RANK": manifest.parallel.num_kv_heads_per_rank, "HEAD_DIM": manifest.model.head_dim}
    shapes = layer_shapes(manifest)
    if shapes:
        want["LAYER_SHAPES"] = shapes
    return want


def attention_calls(probe) -> list[dict]:
    return probe.fa_calls


def verify_expectation(manifest, plan) -> tuple[int, bool]:
    """(sparse_mode, mask) of an MTP verify step's call (q_len 1 + next_n): a sliding layer keeps its band, a full
    layer takes the manifest's MTP decision."""
    if plan.is_sliding or manifest.mtp is None:
        return plan.sparse_mode.decode, plan.mask.decode != "none"
    return manifest.mtp.decode_sparse_mode, manifest.mtp.decode_mask != "none"


def spec_prompts(manifest, default: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The speculative-decode stream's (prompt length, verify steps): the stream's default."""
    return default


def poison_rejected_drafts(manifest, host, runner, rows, kept, ends) -> int:
    """After a standalone verify step: NaN into what this kind's rejected drafts left beyond the K/V slots (nothing
    here: their slots are rewritten by the next step's own positions). Returns the entries poisoned."""
    return 0


def shrink_notes(manifest, short) -> list[str]:
    """What a CPU-sized copy of the manifest changed about this kind beyond the window (nothing)."""
    return []


def check_attention_calls(report, manifest, host, *, before_failure: bool = False) -> None:
    """V209: every FA call passes what the manifest decided for its layer and path."""
    if before_failure:
        check_fa_calls_before_failure(report, manifest, host.probe.fa_calls)
    else:
        check_fa_calls(report, manifest, host.probe.fa_calls)


def shard_attention(attn, model, heads: slice, rank: int, tp: int) -> int:
    """Keep one attention-TP rank's query heads and KV heads in a transformers attention module (the multi-rank
    run); returns the value head dim the output projection's columns are cut by."""
    d = model.head_dim
    own = getattr(attn, "head_dim", None)
    if isinstance(own, int) and not isinstance(own, bool) and own != d and attn.k_proj.out_features % own == 0:
        d = own  # a layer with its own shape (Gemma-4's full layers: global_head_dim)
    # the layer's own KV heads from its own projection (Gemma-4's num_global_key_value_heads, MiMo-V2-Flash's doubled
    # sliding layers), and its value heads' width (MiMo-V2-Flash: 128 beside 192-dim keys)
    kv_heads = attn.k_proj.out_features // d
    vd = attn.v_proj.out_features // kv_heads if attn.v_proj is not None else d
    # a gated attention (Qwen3-Next, Qwen3.5) projects [query | gate] per head: 2 x head_dim rows a head
    per = attn.q_proj.out_features // model.num_attention_heads
    attn.q_proj.weight = keep_rows(attn.q_proj.weight, heads.start * per, heads.stop * per)
    if attn.q_proj.bias is not None:
        attn.q_proj.bias = keep_rows(attn.q_proj.bias, heads.start * per, heads.stop * per)
    # an output gate of its own, sigmoid(gate_proj(x)) times each head's output (HRM-text): this rank's heads' rows
    gate = getattr(attn, "gate_proj", None)
    if isinstance(gate, torch.nn.Linear) and gate.out_features % model.num_attention_heads == 0:
        g = gate.out_features // model.num_attention_heads
        gate.weight = keep_rows(gate.weight, heads.start * g, heads.stop * g)
        if gate.bias is not None:
            gate.bias = keep_rows(gate.bias, heads.start * g, heads.stop * g)
    lo, hi = kv_head_of_rank(rank, tp, kv_heads)
    for proj, width in ((attn.k_proj, d), (attn.v_proj, vd)):
        if proj is None:  # K = V (Gemma-4's attention_k_eq_v full layers): the values are the keys' projection
            continue
        proj.weight = keep_rows(proj.weight, lo * width, hi * width)
        if proj.bias is not None:
            proj.bias = keep_rows(proj.bias, lo * width, hi * width)
    if getattr(attn, "sinks", None) is not None:  # MiMo-V2-Flash's full layers keep sinks None
        attn.sinks = torch.nn.Parameter(attn.sinks.data[heads].clone(), requires_grad=False)
    # head counts the module's own forward reshapes by (StableLM: view(bsz, q_len, self.num_heads, head_dim)) and
    # per-head norms (StableLM's qk_layernorm: one LayerNorm per head): this rank's share
    for attr, total, share in (("num_heads", model.num_attention_heads, heads.stop - heads.start),
                               ("num_key_value_heads", kv_heads, hi - lo)):
        if getattr(attn, attr, None) == total and total != share:
            setattr(attn, attr, share)
    for norm, keep in ((getattr(attn, "q_layernorm", None), heads), (getattr(attn, "k_layernorm", None), slice(lo, hi))):
        per_head = getattr(norm, "norms", None)
        if isinstance(per_head, torch.nn.ModuleList) and getattr(norm, "num_heads", None) == len(per_head):
            norm.norms = torch.nn.ModuleList(list(per_head)[keep])
            norm.num_heads = len(norm.norms)
    return vd
