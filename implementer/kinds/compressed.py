"""DeepSeek-V4 compressed attention (CSA / HCA), render side: planned by the analyzer (analyzer/kinds/compressed.py),
not rendered yet. A render through the GQA partial would write two K/V caches per layer and FA calls over the
window alone: the compressed branch, its compressor state and the indexer silently missing."""

from __future__ import annotations

from model_infer_kvcache.implementer.kinds.common import bad

NAME = "compressed"


def check(m) -> None:
    if m.compressed is not None:
        c = m.compressed
        raise bad("compressed", f"not supported by kvcache: rendering DeepSeek-V4 compressed attention "
                                f"({len(c.csa_layers)} CSA, {len(c.hca_layers)} HCA layer(s)): no template writes the "
                                "compressed entries, the compressor states or the custom.npu_sparse_attn_sharedkv "
                                "call yet; the manifest's plan (layers[].compressed, memory.groups, "
                                "compressed.operators) is the design to implement by hand")
