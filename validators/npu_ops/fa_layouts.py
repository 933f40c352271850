"""``input_layout`` strings of the fused attention operators and the tensor views they imply.

The table mirrors the layout map of torch_npu's meta registration
(``op_plugin/meta/_meta_registrations.py``): each string names the query layout and the
output layout (``BNSD_BSND`` = BNSD in, BSND out). Key/value of the non-paged path use the
query's layout; paged caches have their own forms (see ``fa_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# input_layout -> (query layout, output layout)
LAYOUTS: dict[str, tuple[str, str]] = {
    "BSH": ("BSH", "BSH"),
    "BSND": ("BSND", "BSND"),
    "BNSD": ("BNSD", "BNSD"),
    "TND": ("TND", "TND"),
    "NTD": ("NTD", "NTD"),
    "BNSD_BSND": ("BNSD", "BSND"),
    "BSH_BNSD": ("BSH", "BNSD"),
    "BSND_BNSD": ("BSND", "BNSD"),
    "NTD_TND": ("NTD", "TND"),
    "BSH_NBSD": ("BSH", "NBSD"),
    "BSND_NBSD": ("BSND", "NBSD"),
    "BNSD_NBSD": ("BNSD", "NBSD"),
    "TND_NTD": ("TND", "NTD"),
    "NSD": ("NSD", "NSD"),
}
PACKED_QUERY_LAYOUTS = ("TND", "NTD")
QUERY_DIMS = {"BSH": 3, "BSND": 4, "BNSD": 4, "NSD": 3, "TND": 3, "NTD": 3}


@dataclass(frozen=True)
class Layout:
    name: str
    query: str
    out: str

    @property
    def packed(self) -> bool:
        return self.query in PACKED_QUERY_LAYOUTS


def parse_layout(name: str) -> Layout | None:
    if name not in LAYOUTS:
        return None
    q, o = LAYOUTS[name]
    return Layout(name, q, o)


def batch_view(t: torch.Tensor, layout: str, num_heads: int) -> torch.Tensor:
    """A batch-layout tensor as ``[B, S, N, D]`` (a view where possible)."""
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, num_heads, h // num_heads)
    if layout == "BSND":
        return t
    if layout == "BNSD":
        return t.transpose(1, 2)
    if layout == "NSD":
        return t.unsqueeze(0).transpose(1, 2)
    raise ValueError(layout)


def packed_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A packed-layout tensor as ``[T, N, D]``."""
    return t if layout == "TND" else t.transpose(0, 1)


_N_AXIS = {"BSND": 2, "BNSD": 1, "NSD": 0, "TND": 1, "NTD": 0}


def heads_axis_size(t: torch.Tensor, layout: str) -> int | None:
    """The N axis of ``t`` in ``layout`` (None for BSH, whose N comes from ``num_heads``)."""
    axis = _N_AXIS.get(layout)
    return None if axis is None else int(t.shape[axis])


def batch_output(out: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, S, N, Dv]`` -> the requested batch output layout."""
    if layout == "BSH":
        b, s, n, d = out.shape
        return out.reshape(b, s, n * d)
    if layout == "BSND":
        return out
    if layout == "BNSD":
        return out.permute(0, 2, 1, 3)
    if layout == "NBSD":
        return out.permute(2, 0, 1, 3)
    if layout == "NSD":
        return out[0].transpose(0, 1)
    raise ValueError(layout)


def packed_output(out: torch.Tensor, layout: str) -> torch.Tensor:
    """``[T, N, Dv]`` -> TND or NTD."""
    return out if layout == "TND" else out.transpose(0, 1)
