"""Benchmark: emulated fused attention vs ``scaled_dot_product_attention`` on the same data.

Cases (float32, 32 query heads / 8 KV heads, head dim 128):

* ``decode``: paged FA decode, batch 16, KV length 2048, block size 128, cache passed as
  ``[block_num, block_size, N_kv * D]`` (the form the rendered GQA code uses) with a shuffled
  block table (TND, sparse_mode 3).
* ``decode_hm``: the same decode with the cache passed head-major, ``[block_num, N_kv, block_size, D]``
  (the form the op documentation recommends for speed).
* ``prefill_paged``: TND prefill of 4 x 1024 tokens reading the same kind of paged cache.
* ``prefill``: TND prefill of 4 x 1024 tokens with packed (non-paged) K/V.

SDPA gets the same values held contiguously (``[B, N, S, D]``, ``enable_gqa=True``, causal
for prefill). Each side is timed ``--repeats`` times, interleaved, and the best time of
each is compared; the printed ratio is emulation / SDPA (targets: decode <= 1.5,
prefill <= 2.0 on a 2-core machine). Run: ``python benchmarks/bench_npu_ops.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from model_infer_kvcache.validators.npu_ops import emulated

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
TARGETS = {"decode": 1.5, "decode_hm": 1.5, "prefill_paged": 2.0, "prefill": 2.0}


def _paged_cache(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator, head_major: bool = False):
    """Scatter contiguous ``[B, S, N_kv, D]`` K/V into a shuffled paged cache (block 0 = null)."""
    b, s, n, d = k.shape
    per_seq = s // BLOCK
    num_blocks = b * per_seq + 1
    table = (torch.randperm(b * per_seq, generator=gen) + 1).view(b, per_seq).to(torch.int32)
    k_cache = torch.zeros(num_blocks, BLOCK, n * d)
    v_cache = torch.zeros(num_blocks, BLOCK, n * d)
    k_cache[table.long().view(-1)] = k.reshape(b * per_seq, BLOCK, n * d)
    v_cache[table.long().view(-1)] = v.reshape(b * per_seq, BLOCK, n * d)
    if head_major:
        k_cache = k_cache.view(num_blocks, BLOCK, n, d).transpose(1, 2).contiguous()
        v_cache = v_cache.view(num_blocks, BLOCK, n, d).transpose(1, 2).contiguous()
    return k_cache, v_cache, table


def _case(name: str, gen: torch.Generator):
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    scale = HEAD_DIM ** -0.5
    if name.startswith("decode"):
        b, s_kv, s_q = 16, 2048, 1
    else:
        b, s_kv, s_q = 4, 1024, 1024
    q = torch.randn(b, s_q, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(b, s_kv, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(b, s_kv, KV_HEADS, HEAD_DIM, generator=gen)
    q_cum = [s_q * (i + 1) for i in range(b)]
    q_tnd = q.reshape(b * s_q, HEADS, HEAD_DIM)

    if name == "prefill":
        k_tnd = k.reshape(b * s_kv, KV_HEADS, HEAD_DIM)
        v_tnd = v.reshape(b * s_kv, KV_HEADS, HEAD_DIM)

        def emu():
            return emulated.npu_fused_infer_attention_score(
                q_tnd, k_tnd, v_tnd, atten_mask=mask, actual_seq_lengths=q_cum,
                actual_seq_lengths_kv=[s_kv * (i + 1) for i in range(b)], num_heads=HEADS,
                num_key_value_heads=KV_HEADS, scale=scale, input_layout="TND", sparse_mode=3)[0]
    else:
        k_cache, v_cache, table = _paged_cache(k, v, gen, head_major=name == "decode_hm")

        def emu():
            return emulated.npu_fused_infer_attention_score(
                q_tnd, k_cache, v_cache, atten_mask=mask, actual_seq_lengths=q_cum,
                actual_seq_lengths_kv=[s_kv] * b, block_table=table, block_size=BLOCK, num_heads=HEADS,
                num_key_value_heads=KV_HEADS, scale=scale, input_layout="TND", sparse_mode=3)[0]

    q_sdpa = q.transpose(1, 2).contiguous()
    k_sdpa = k.transpose(1, 2).contiguous()
    v_sdpa = v.transpose(1, 2).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, is_causal=s_q > 1, scale=scale,
                                              enable_gqa=True)

    return emu, sdpa, (b, s_q)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(cases: list[str], repeats: int, check: bool) -> dict[str, tuple[float, float, float]]:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for name in cases:
        emu, sdpa, (b, s_q) = _case(name, gen)
        if check:
            got = emu().view(b, s_q, HEADS, HEAD_DIM)
            ref = sdpa().transpose(1, 2)
            err = (got - ref).abs().max().item()
            if err > 1e-4:
                raise AssertionError(f"{name}: emulation differs from SDPA by {err}")
        emu(), sdpa()  # warm-up
        t_emu, t_sdpa = [], []
        for _ in range(repeats):
            t_emu.append(_timed(emu))
            t_sdpa.append(_timed(sdpa))
        best_emu, best_sdpa = min(t_emu), min(t_sdpa)
        results[name] = (best_emu, best_sdpa, best_emu / best_sdpa)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-check", action="store_true", help="skip the numeric cross-check")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (t_emu, t_sdpa, ratio) in run(args.cases, args.repeats, not args.no_check).items():
        verdict = "ok" if ratio <= TARGETS[name] else "ABOVE TARGET"
        print(f"{name:14s} emulation {t_emu * 1e3:8.1f} ms   sdpa {t_sdpa * 1e3:8.1f} ms   "
              f"ratio {ratio:5.2f} (target <= {TARGETS[name]}) {verdict}")


if __name__ == "__main__":
    main()
