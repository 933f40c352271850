"""Hypothesis state machine over the pool and managers (mixed FullAttention + SlidingWindow groups).

Random admit / decode / finish sequences; after every step the invariants of the issue hold:
no block owned twice, owned + free + null = total, the null block never owned, sliding
requests hold exactly the blocks their window needs, and everything returns on free.
"""

import copy
import math

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from model_infer_kvcache.validators.harness import KVCacheManager, check_pool_invariants, get_generation

FULL_BS, SLIDING_BS, LATENT_BS = 4, 2, 8


def _cache_info(window):
    g = get_generation("G2")

    def kv(attn, bs, key=None, w=None):
        return [g.CacheEntry(n, attn, 4, 1, torch.float32, True, block_size=bs, manager_key=key, sliding_window=w)
                for n in ("k_cache", "v_cache")]

    layers = [
        g.LayerCacheInfo(0, kv("FullAttention", FULL_BS)),
        g.LayerCacheInfo(1, kv("SlidingWindow", SLIDING_BS, w=window)),
        g.LayerCacheInfo(2, kv("FullAttention", LATENT_BS, key="latent")),
    ]
    return g.ModelCacheInfo(3, layers)


def _snapshot(kv):
    return [(copy.deepcopy(m.req_to_blocks), m.block_pool.free_block_ids()) for m in kv.single_type_managers]


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        window=st.integers(1, 7),
        extra=st.sampled_from([0, 1]),
        full_blocks=st.integers(3, 14),
        sliding_blocks=st.integers(3, 10),
        latent_blocks=st.integers(2, 8),
    )
    def setup(self, window, extra, full_blocks, sliding_blocks, latent_blocks):
        self.kept = window + extra
        self.kv = KVCacheManager.from_cache_info(
            _cache_info(window),
            {"FullAttention": full_blocks, "SlidingWindow": sliding_blocks, "latent": latent_blocks},
            max_model_len=48,
            extra_window_keys=extra,
        )
        self.tokens: dict[int, int] = {}  # request id -> tokens its tables cover
        self.next_id = 0

    def _refused_without_change(self, call):
        before = _snapshot(self.kv)
        ok = call()
        if not ok:
            assert _snapshot(self.kv) == before, "failed allocate_slots changed state"
        return ok

    @rule(length=st.integers(1, 30))
    def admit(self, length):
        rid = self.next_id
        self.next_id += 1
        if self._refused_without_change(lambda: self.kv.allocate_slots(rid, 0, length)):
            self.tokens[rid] = length

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        total = self.tokens[rid]
        if total >= 48:
            return
        if self._refused_without_change(lambda: self.kv.allocate_slots(rid, total, 1)):
            self.tokens[rid] = total + 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid]

    @rule()
    def finish_all(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        self.tokens.clear()
        for m in self.kv.single_type_managers:
            assert m.get_num_free_blocks() == m.block_pool.num_blocks - 1
            assert not m.req_to_blocks

    @invariant()
    def pools_consistent(self):
        if not hasattr(self, "kv"):
            return
        for report in check_pool_invariants(self.kv):
            assert not report.problems, report

    @invariant()
    def tables_hold_exactly_the_needed_blocks(self):
        if not hasattr(self, "kv"):
            return
        for m in self.kv.single_type_managers:
            null = m.block_pool.get_null_block()
            assert set(m.req_to_blocks) == set(self.tokens)
            for rid, total in self.tokens.items():
                blocks = m.req_to_blocks[rid]
                assert len(blocks) == math.ceil(total / m.block_size)
                real = [i for i, b in enumerate(blocks) if b != null]
                if m.attn_type == "SlidingWindow":
                    # Storage only from the block of the first token the newest query reads.
                    first = max(0, total - self.kept) // m.block_size
                else:
                    first = 0
                assert real == list(range(first, len(blocks))), (m.manager_key, rid, total, blocks)


PoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_state_machine = PoolMachine.TestCase
