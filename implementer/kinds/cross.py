"""The cross-attention slots of an encoder-decoder model's decoder (templates/kinds/cross_attention.py.j2): one slot
per request holding the K/V of its encoder states, written at its prefill and read by every step without a mask."""

from __future__ import annotations

from dataclasses import dataclass

from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kv_cache_spec import CROSS_ATTENTION
from model_infer_kvcache.implementer.kinds.common import bad

NAME = "cross-attention slot"


@dataclass(frozen=True)
class CrossCtx:
    """What the partial needs (manifest.cross_attention, one rank)."""

    module_attr: str  # the decoder layer's cross-attention module, as transformers names it
    group_key: str  # the framework's manager_key of the slot entries (block_table key)
    max_encoder_len: int
    num_kv_heads: int
    head_dim: int
    slot_block_size: int
    slot_tokens: int
    self_attention: bool = True  # False: cross-attention-only blocks (Mllama), their slots a cache layer of their own
    stated: bool = False  # max_encoder_len is the user's --encoder-length (manifest max_encoder_len_from), said in the render
    key: str = cross_kind.KEY
    value: str = cross_kind.VALUE
    length: str = cross_kind.LENGTH

    @property
    def slot_blocks(self) -> int:
        return self.slot_tokens // self.slot_block_size


def check_layers(m) -> None:
    """What the partial does not render, named: a Legacy (contiguous) cache, speculative decoding over the slots,
    multi-rank heads, a hybrid's recurrent states beside them, an MLA self-attention."""
    x = m.cross_attention
    where = "cross_attention"
    if m.kv_mode.value != "paged":
        raise bad("kv_mode", f"not supported by kvcache: a Legacy (contiguous) cache beside the {len(x.layers)} "
                             "cross-attention layers' slots; the templates render them with the paged cache only")
    if m.mtp is not None and m.mtp.speculative_tokens:
        raise bad("mtp", "not supported by kvcache: speculative decoding over an encoder-decoder decoder (the "
                         "verify step's cross-attention reads are not rendered); render with --next-n 0")
    if m.parallel.attn_tp_size != 1:
        raise bad("parallel.attn_tp_size", f"not supported by kvcache: attention TP {m.parallel.attn_tp_size} with "
                                           "cross-attention slots (their heads' split is not rendered or validated); "
                                           "render with --attn-tp-size 1")
    if m.linear_attention is not None or m.mla.enabled:
        raise bad(where, "not supported by kvcache: cross-attention beside recurrent states or MLA layers")
    if x.slot_tokens % x.slot_block_size or x.slot_tokens < x.max_encoder_len:
        raise bad(f"{where}.slot_tokens", f"{x.slot_tokens} is not {x.max_encoder_len} rounded up to whole blocks "
                                          f"of {x.slot_block_size}")


def check(m) -> None:
    """Nothing beyond check_layers."""


def fields(m) -> dict:
    x = m.cross_attention
    return {"cross": CrossCtx(x.module_attr, CROSS_ATTENTION, int(x.max_encoder_len), int(x.num_kv_heads_per_rank),
                              int(x.head_dim), int(x.slot_block_size), int(x.slot_tokens), x.self_attention,
                              stated=x.max_encoder_len_from == cross_kind.USER_INPUT)}
