"""Independent float64 reference for the fused attention operators, plus input builders.

Written separately from ``validators.npu_ops``: per-request, per-token Python loops over
dense tensors, the visibility rule spelled out from the op documentation (references/fa_operators.md,
'sparse_mode 与 atten_mask').
Other ``test_npu_ops_*`` files import the helpers; the tests at the bottom check the
reference itself against hand-computed values.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from model_infer_kvcache.analyzer.operators.fa_facts import INT32_MAX as INT_MAX

MASK_2048 = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


# --------------------------------------------------------------------------- reference
def ref_visible(i: int, j: int, q_len: int, kv_len: int, mode: int, pre: int, nxt: int,
                user_mask_row=None, band_ignored: bool = False, inclusive: bool = False) -> bool:
    """May query row ``i`` see key ``j`` (both 0-based, per request)?"""
    if j >= kv_len or i >= q_len:
        return False
    if user_mask_row is not None and mode in (0, 1) and bool(user_mask_row[j]):
        return False
    if band_ignored and mode in (0, 2, 3, 4):
        return True
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + kv_len - q_len
    if mode == 4 or (mode == 0 and user_mask_row is not None):
        origin = i + kv_len - q_len if mode == 4 else i
        low = origin - pre + 1 if inclusive else origin - pre
        return low <= j <= origin + nxt
    return True


def ref_attention(q, k, v, *, scale, mode=0, pre=INT_MAX, nxt=INT_MAX, q_rope=None, k_rope=None,
                  sinks=None, user_mask=None, band_ignored=False, inclusive=False):
    """One request. q [Sq, N, D], k [Skv, Nkv, D], v [Skv, Nkv, Dv]; returns (out [Sq, N, Dv], lse [Sq, N])."""
    q, k, v = q.double(), k.double(), v.double()
    sq, n_heads, _ = q.shape
    skv, n_kv, dv = v.shape
    group = n_heads // n_kv
    rows = []
    for i in range(sq):
        mask_row = None if user_mask is None else user_mask[i].tolist()
        rows.append([ref_visible(i, j, sq, skv, mode, pre, nxt, mask_row, band_ignored, inclusive)
                     for j in range(skv)])
    vis = torch.tensor(rows, dtype=torch.bool).view(sq, skv)
    out = torch.zeros(sq, n_heads, dv, dtype=torch.float64)
    lse = torch.full((sq, n_heads), -math.inf, dtype=torch.float64)
    for n in range(n_heads):
        h = n // group
        logits = q[:, n] @ k[:, h].T
        if q_rope is not None:
            logits = logits + q_rope[:, n].double() @ k_rope[:, h].double().T
        logits = (logits * scale).masked_fill(~vis, -math.inf)
        if sinks is not None:
            logits = torch.cat([logits, sinks[n].double().expand(sq, 1)], dim=1)
        m = logits.max(dim=1, keepdim=True).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(logits - m)
        denom = w.sum(dim=1, keepdim=True)
        num = w[:, :skv] @ v[:, h]
        out[:, n] = torch.where(denom > 0, num / torch.where(denom > 0, denom, torch.ones_like(denom)), 0.0)
        lse[:, n] = (m + torch.log(denom)).squeeze(1)
    return out, lse


# --------------------------------------------------------------------------- builders
@dataclass
class Case:
    """Per-request dense data; ``to_*`` methods pack it into operator inputs."""

    q: list
    k: list
    v: list
    num_heads: int
    num_kv: int
    q_rope: list | None = None
    k_rope: list | None = None
    sinks: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def batch(self):
        return len(self.q)

    @property
    def q_lens(self):
        return [t.shape[0] for t in self.q]

    @property
    def kv_lens(self):
        return [t.shape[0] for t in self.k]

    def reference(self, *, scale, mode=0, pre=INT_MAX, nxt=INT_MAX, user_masks=None,
                  band_ignored=None, inclusive=False):
        outs, lses = [], []
        for b in range(self.batch):
            ignored = bool(band_ignored[b]) if band_ignored is not None else False
            o, l_ = ref_attention(
                self.q[b], self.k[b], self.v[b], scale=scale, mode=mode, pre=pre, nxt=nxt,
                q_rope=None if self.q_rope is None else self.q_rope[b],
                k_rope=None if self.k_rope is None else self.k_rope[b],
                sinks=self.sinks, user_mask=None if user_masks is None else user_masks[b],
                band_ignored=ignored, inclusive=inclusive)
            outs.append(o)
            lses.append(l_)
        return outs, lses


def make_case(q_lens, kv_lens, num_heads, num_kv, dim, *, value_dim=None, rope=False, sinks=False,
              dtype=torch.float32, seed=0, same_kv=False):
    gen = torch.Generator().manual_seed(seed)
    value_dim = value_dim or dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = [rnd(s, num_heads, dim) for s in q_lens]
    k = [rnd(s, num_kv, dim) for s in kv_lens]
    v = k if same_kv else [rnd(s, num_kv, value_dim) for s in kv_lens]
    case = Case(q, k, v, num_heads, num_kv)
    if rope:
        case.q_rope = [rnd(s, num_heads, 64) for s in q_lens]
        case.k_rope = [rnd(s, num_kv, 64) for s in kv_lens]
    if sinks:
        case.sinks = rnd(num_heads)
    return case


def pack(tensors):
    """List of [S_b, N, D] -> [T, N, D] and the cumulative lengths."""
    cum, total = [], 0
    for t in tensors:
        total += t.shape[0]
        cum.append(total)
    return torch.cat(tensors, dim=0), cum


def pad(tensors, length=None):
    """List of [S_b, N, D] -> zero-padded [B, S, N, D]."""
    length = length or max(t.shape[0] for t in tensors)
    n, d = tensors[0].shape[1:]
    out = torch.zeros(len(tensors), length, n, d, dtype=tensors[0].dtype)
    for b, t in enumerate(tensors):
        out[b, :t.shape[0]] = t
    return out


def to_batch_layout(t4: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, S, N, D] -> BSH / BSND / BNSD / NSD tensor."""
    if layout == "BSH":
        return t4.reshape(t4.shape[0], t4.shape[1], -1).contiguous()
    if layout == "BSND":
        return t4.contiguous()
    if layout == "BNSD":
        return t4.transpose(1, 2).contiguous()
    if layout == "NSD":
        return t4[0].transpose(0, 1).contiguous()
    raise ValueError(layout)


def from_out_layout(out: torch.Tensor, out_layout: str, num_heads: int) -> torch.Tensor:
    """Operator output -> [B, S, N, Dv] (batch) or [T, N, Dv] (packed)."""
    if out_layout == "BSH":
        return out.view(out.shape[0], out.shape[1], num_heads, -1)
    if out_layout == "BSND" or out_layout == "TND":
        return out
    if out_layout == "BNSD":
        return out.transpose(1, 2)
    if out_layout == "NBSD":
        return out.permute(1, 2, 0, 3)
    if out_layout == "NTD":
        return out.transpose(0, 1)
    if out_layout == "NSD":
        return out.transpose(0, 1).unsqueeze(0)
    raise ValueError(out_layout)


@dataclass
class PagedCache:
    k: torch.Tensor
    v: torch.Tensor
    k_rope: torch.Tensor | None
    table: torch.Tensor
    block_size: int


def build_paged(case: Case, block_size: int, form: str, *, extra_blocks=3, seed=0, poison=float("nan"),
                null_columns=None, shared=None, table_width=None):
    """Scatter the case's K/V into a shuffled paged cache.

    ``form``: "3d" ([bn, bs, N*D]), "4d" ([bn, N, bs, D]) or "nz" ([bn, N, D/16, bs, 16]).
    Block 0 is the null block; it and every slot not holding data are set to ``poison``.
    ``null_columns[b]``: block columns of request b that point at the null block instead of
    data (slid-out sliding-window blocks). ``shared``: (b_src, col, b_dst, col) makes b_dst
    reuse b_src's physical block (a shared prefix block).
    """
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in case.kv_lens]
    width = table_width or max(need)
    total = sum(need) + extra_blocks + 1
    free = list(range(1, total))
    rng.shuffle(free)
    table = torch.zeros(case.batch, width, dtype=torch.int32)
    for b in range(case.batch):
        for c in range(need[b]):
            if null_columns and c in null_columns.get(b, ()):
                continue
            table[b, c] = free.pop()
    if shared:
        b_src, c_src, b_dst, c_dst = shared
        table[b_dst, c_dst] = table[b_src, c_src]

    def fill(tensors, dim):
        canon = torch.full((total, block_size, case.num_kv, dim), poison, dtype=tensors[0].dtype)
        for b, t in enumerate(tensors):
            for pos in range(t.shape[0]):
                blk = int(table[b, pos // block_size])
                if blk == 0:
                    continue
                canon[blk, pos % block_size] = t[pos]
        if form == "3d":
            return canon.reshape(total, block_size, -1)
        head_major = canon.permute(0, 2, 1, 3).contiguous()  # [bn, N, bs, D]
        if form == "4d":
            return head_major
        c0 = 16
        return head_major.view(total, case.num_kv, block_size, dim // c0, c0).permute(0, 1, 3, 2, 4).contiguous()

    k = fill(case.k, case.k[0].shape[-1])
    v = k if case.v is case.k else fill(case.v, case.v[0].shape[-1])
    kr = fill(case.k_rope, 64) if case.k_rope is not None else None
    return PagedCache(k, v, kr, table, block_size)


def max_err(got_list, ref_list) -> float:
    return max(float((g.double() - r).abs().max()) if g.numel() else 0.0 for g, r in zip(got_list, ref_list,
                                                                                          strict=True))


def split_packed(t: torch.Tensor, lens) -> list:
    out, s = [], 0
    for n in lens:
        out.append(t[s:s + n])
        s += n
    return out


def split_padded(t: torch.Tensor, lens) -> list:
    return [t[b, :n] for b, n in enumerate(lens)]


# --------------------------------------------------------------------------- self-tests
def test_reference_single_key_is_its_value():
    q = torch.randn(1, 2, 4)
    k = torch.randn(1, 1, 4)
    v = torch.randn(1, 1, 3)
    out, lse = ref_attention(q, k, v, scale=0.5)
    assert torch.allclose(out[0, 0], v[0, 0].double())
    assert torch.allclose(out[0, 1], v[0, 0].double())
    assert torch.allclose(lse[0, 0], 0.5 * (q[0, 0] @ k[0, 0]).double())


def test_reference_uniform_query_averages_visible_values():
    q = torch.zeros(3, 1, 4)
    k = torch.randn(5, 1, 4)
    v = torch.arange(5, dtype=torch.float64).view(5, 1, 1)
    out, _ = ref_attention(q, k, v, scale=1.0, mode=3)
    # right-down causal: row i sees keys 0..i+2
    assert out[:, 0, 0].tolist() == [1.0, 1.5, 2.0]


def test_reference_band_rule_and_sink():
    assert ref_visible(4, 2, 5, 5, 4, 2, 0) and not ref_visible(4, 1, 5, 5, 4, 2, 0)
    assert not ref_visible(4, 2, 5, 5, 4, 2, 0, inclusive=True)
    q = torch.zeros(1, 1, 2)
    k = torch.zeros(1, 1, 2)
    v = torch.ones(1, 1, 1)
    out, lse = ref_attention(q, k, v, scale=1.0, sinks=torch.zeros(1))
    assert out.item() == 0.5 and abs(lse.item() - math.log(2)) < 1e-12
