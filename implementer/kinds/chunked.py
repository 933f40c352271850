"""Chunked local attention (Llama-4's RoPE layers): what the GQA partial needs to read a chunk, what it refuses
(templates/kinds/gqa_attention.py.j2, the ``chunk_size`` branches).

A query at position p attends the keys in [floor(p / C) * C, p]. FA's band (pre_tokens / next_tokens) is one value
for the whole batch, so a chunk is not a band; the partial reads it in two ways:

- prefill: each request's queries are split at its chunk boundaries into virtual requests (one per chunk, the
  cumulative lengths of the packed TND call), each causal over its own chunk's keys (this step's own K/V, like the
  sliding prefill: the framework maps prompt blocks before the last C tokens to the null block);
- decode (q_len 1): the request's block table shifted by ``chunk_start // block_size`` (C is a multiple of the block
  size, a blocker otherwise) and its KV length counted from the chunk start, ``p - chunk_start + 1``.
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.kinds import holds_chunks
from model_infer_kvcache.implementer.kinds.common import bad

NAME = "chunked local attention"


def check_layers(m) -> None:
    """One chunk for every chunked layer, a multiple of the block size."""
    chunks = {layer.attention_chunk_size for layer in m.attention_layers if layer.is_chunked}
    first = next(layer for layer in m.attention_layers if layer.is_chunked)
    if len(chunks) != 1:
        raise bad(f"layers[{first.index}].attention_chunk_size", f"chunked layers disagree on their chunk "
                                                                 f"({sorted(chunks)}); the render holds one")
    chunk = chunks.pop()
    if m.kv_mode.value == "paged" and chunk % m.block_size:
        raise bad(f"layers[{first.index}].attention_chunk_size",
                  f"{chunk} is not a multiple of block_size {m.block_size}: a chunk would start inside a block, "
                  "which the shifted block table of the decode step cannot express")


def check(m) -> None:
    """What the chunked partial does not render, by name."""
    where = next(layer.index for layer in m.attention_layers if layer.is_chunked)
    if m.kv_mode.value != "paged":
        raise bad("kv_mode", f"{m.kv_mode.value} with chunked local attention (layers[{where}]): the Legacy "
                             "template's one FA call has no chunk boundaries (a causal mask would be silently "
                             "wrong); plan it paged")
    if m.mtp is not None and m.model.num_mtp_layers:
        raise bad("mtp", "speculative decoding with chunked local attention: a verify step's 1 + next_n queries may "
                         "cross a chunk boundary, which the decode step's one shifted block table does not split")
    if m.exe_mode is not None and m.exe_mode.value != "eager":
        raise bad("exe_mode", f"{m.exe_mode.value} decode with chunked local attention: the chunk's block table "
                              "and KV lengths are built inside the step (serve decode eagerly)")


def fields(m) -> dict:
    chunked = [layer for layer in m.attention_layers if layer.is_chunked]
    return {"chunk_size": int(chunked[0].attention_chunk_size),
            "chunked_layers": tuple(layer.index for layer in chunked)}


def present(m) -> bool:
    return holds_chunks(m)
