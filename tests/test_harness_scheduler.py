"""Scheduler loop end to end with the toy framework-mode model, and the poisoning checks.

The toy model writes K/V through slot_mapping[key] and reads decode keys through
block_table[key]; its dense reference has no cache at all, so any indexing mistake in
the harness changes the generated tokens.
"""

import pytest
import torch
from model_infer_kvcache.validators.harness import Scheduler, SchedulerStall, read_positions
from model_infer_kvcache.validators.harness.toy_model import ToyLayerSpec, ToyModel

MIXED = [
    ToyLayerSpec("FullAttention", block_size=4),
    ToyLayerSpec("SlidingWindow", sliding_window=5, block_size=2),
    ToyLayerSpec("FullAttention", block_size=8, manager_key="latent"),
]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 1], [5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5], [7, 8, 9, 10]]


def _no_nan_and_invariants(sched, step, out):
    assert not torch.isnan(out[step.last_token_rows()]).any(), f"NaN at step {step.index}"
    sched.check_invariants()


def test_mixed_g2_generation_matches_dense_reference_under_poisoning():
    model = ToyModel(MIXED, generation="G2")
    sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=3)
    start_usage = sched.usage()
    ids = [sched.add_request(p, max_new_tokens=10) for p in PROMPTS]
    out = sched.run(model, poison=True, on_step=_no_nan_and_invariants)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        assert out[rid] == model.reference_generate(prompt, 10)
    assert sched.usage() == start_usage  # release link: every block came back


@pytest.mark.parametrize("gen", ["G0", "G1"])
def test_g0_g1_generation_matches_reference(gen):
    layers = [ToyLayerSpec("FullAttention"), ToyLayerSpec("SlidingWindow", sliding_window=3)]
    model = ToyModel(layers, generation=gen, block_size=4, seed=3)
    sched = Scheduler(model.get_cache_info(), max_model_len=32, max_concurrency=2, generation=gen)
    ids = [sched.add_request(p, max_new_tokens=8) for p in PROMPTS[:3]]
    out = sched.run(model, poison=True, on_step=_no_nan_and_invariants)
    for rid, prompt in zip(ids, PROMPTS[:3], strict=True):
        assert out[rid] == model.reference_generate(prompt, 8)


def test_step_shapes_and_first_decode_reads_prompt_plus_one():
    model = ToyModel(MIXED)
    sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=2)
    a = sched.add_request(PROMPTS[0], max_new_tokens=3)
    b = sched.add_request(PROMPTS[1], max_new_tokens=3)
    step = sched.next_step()
    fm = step.forward_metadata
    assert fm.is_prefill and step.input_ids.shape == (11,) and step.position_ids.tolist()[:10] == list(range(9)) + [0]
    assert fm.attention_mask.shape == (2048, 2048) and fm.attention_mask.dtype == torch.bool
    # Legacy per-token kv_len: request slot * max_model_len + position.
    assert fm.kv_len.tolist() == list(range(9)) + [40, 41]
    assert step.token_slices() == {a: slice(0, 9), b: slice(9, 11)}
    assert step.last_token_rows().tolist() == [8, 10]
    sched.complete_step(step, [11, 12])
    assert sched.requests[a].computed_len == 8  # kv_len after prefill = L - 1
    step = sched.next_step()
    fm = step.forward_metadata
    assert not fm.is_prefill and step.input_ids.tolist() == [11, 12]
    assert fm.actual_seq_lengths_kv.tolist() == [10, 3]  # L + 1
    assert fm.actual_seq_lengths_q.tolist() == [1, 1] and fm.actual_seq_lengths_cu_kv.tolist() == [10, 13]
    # Sliding W=5, block 2: prompt 9 kept storage from token 9 - 5 = 4 (logical block 2). The decode at
    # computed 9 may skip 9 - 5 + 1 = 5 tokens = 2 whole blocks, both already null: block 2 stays,
    # since the query at position 9 still reads position 5.
    assert step.readable_positions["SlidingWindow"][a] == (4, 10)
    assert step.readable_positions["FullAttention"][a] == (0, 10)
    for key, owners in step.block_ownership.items():
        assert set(owners) == {a, b}
        assert not set(step.free_blocks[key]) & {blk for blocks in owners.values() for blk in blocks}


def test_finish_early_and_admit_into_freed_blocks():
    model = ToyModel(MIXED, seed=1)
    # Room for exactly two requests at a time.
    sched = Scheduler(model.get_cache_info(), max_model_len=24, max_concurrency=2)
    first = sched.add_request(PROMPTS[2], max_new_tokens=20)
    second = sched.add_request(PROMPTS[3], max_new_tokens=6)
    late = sched.add_request(PROMPTS[0], max_new_tokens=6)
    seen = {}

    def on_step(s, step, out):
        _no_nan_and_invariants(s, step, out)
        if step.index == 3:
            s.finish(first)  # aborted after a few tokens
            seen["freed"] = {k: set(o[first]) for k, o in step.block_ownership.items() if first in o}
        if late in step.request_ids and step.is_prefill:
            seen["late_blocks"] = {k: set(o[late]) for k, o in step.block_ownership.items()}

    out = sched.run(model, poison=True, on_step=on_step)
    assert sched.requests[first].finish_reason == "aborted" and len(out[first]) < 20
    # The late request was admitted only after a slot opened, into recycled blocks.
    assert any(seen["late_blocks"][k] & seen["freed"].get(k, set()) for k in seen["late_blocks"])
    assert out[late] == model.reference_generate(PROMPTS[0], 6)
    assert out[second] == model.reference_generate(PROMPTS[3], 6)
    assert out[first] == model.reference_generate(PROMPTS[2], len(out[first]))


def test_reused_blocks_do_not_leak_old_contents():
    # No poisoning: stale K/V of finished requests stay in the reused blocks. Outputs must not change.
    model = ToyModel(MIXED, seed=2)
    alone = Scheduler(model.get_cache_info(), max_model_len=24, max_concurrency=1)
    rid = alone.add_request(PROMPTS[0], max_new_tokens=8)
    expected = alone.run(model)[rid]
    busy = Scheduler(model.get_cache_info(), max_model_len=24, max_concurrency=1)
    for p in PROMPTS[1:]:
        busy.add_request(p, max_new_tokens=5)
    rid = busy.add_request(PROMPTS[0], max_new_tokens=8)
    assert busy.run(model)[rid] == expected


def test_wrong_table_consumer_is_caught_by_poisoning():
    # Every layer reads next(iter(block_table.values())) - the FullAttention table - instead of its key.
    model = ToyModel(MIXED, seed=4)
    sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=2)
    sched.add_request(PROMPTS[2], max_new_tokens=4)
    step = sched.next_step()
    model(step.input_ids, step.position_ids, step.forward_metadata)
    sched.complete_step(step, [1])
    step = sched.next_step()
    sched.poison()
    model.table_choice = "first"
    real = len(step.request_ids)  # rows past these are decode padding (they read the null block)
    assert step.padded_rows == 1
    assert torch.isnan(model(step.input_ids, step.position_ids, step.forward_metadata)[:real]).all()
    sched.poison()  # the wrong run wrote nothing outside the request's own slots, but be strict
    model.table_choice = "by_key"
    assert not torch.isnan(model(step.input_ids, step.position_ids, step.forward_metadata)[:real]).any()


def test_whole_dict_consumer_fails():
    bad = ToyModel(MIXED, table_choice="whole")
    sched = Scheduler(bad.get_cache_info(), max_model_len=40, max_concurrency=1)
    sched.add_request([1, 2, 3])
    sched.complete_step(sched.next_step(), [4])
    step = sched.next_step()
    with pytest.raises((KeyError, TypeError, AttributeError)):
        bad(step.input_ids, step.position_ids, step.forward_metadata)


def test_reading_a_freed_block_through_a_stale_table_is_caught():
    model = ToyModel(MIXED)
    sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=2)
    a = sched.add_request(PROMPTS[0], max_new_tokens=2)
    step = sched.next_step()
    model(step.input_ids, step.position_ids, step.forward_metadata)
    stale_row = step.forward_metadata.block_table["FullAttention"][0].clone()
    sched.complete_step(step, [1])
    layer = model.layers[0]
    before = read_positions(layer.k_cache, stale_row, torch.arange(9), 4)
    assert not torch.isnan(before).any()
    sched.finish(a)
    sched.poison()
    after = read_positions(layer.k_cache, stale_row, torch.arange(9), 4)
    assert torch.isnan(after).all()


def test_window_off_by_one_is_measurable():
    # A consumer that reads W + 1 keys (band pre_tokens=W) against the framework's retention (W keys)
    # hits released blocks; keeping W + 1 keys (extra_window_keys=1) makes the same consumer exact.
    prompt = PROMPTS[0]
    results = {}
    for extra in (0, 1):
        model = ToyModel([ToyLayerSpec("SlidingWindow", sliding_window=5, block_size=2)], read_extra_keys=1)
        sched = Scheduler(model.get_cache_info(), max_model_len=40, max_concurrency=1, extra_window_keys=extra)
        rid = sched.add_request(prompt, max_new_tokens=10)
        nan_positions = []

        def on_step(s, step, out, nan_positions=nan_positions):
            if torch.isnan(out[step.last_token_rows()]).any():
                nan_positions.append(step.kv_lens[0] - 1)

        out = sched.run(model, poison=True, on_step=on_step)
        results[extra] = (nan_positions, out[rid] == model.reference_generate(prompt, 10, extra_keys=1))
    # Decode query p (positions 9..17) reads p-5..p. At computed p the framework frees the
    # (p - 5 + 1) // 2 leading blocks, so key p-5 is gone exactly when p - 4 is even.
    assert results[0][0] == [10, 12, 14, 16]
    assert results[1] == ([], True)


def test_null_block_writes_are_reported():
    model = ToyModel([ToyLayerSpec("FullAttention", block_size=4)])
    sched = Scheduler(model.get_cache_info(), max_model_len=16, max_concurrency=4, pad_decode_to=3)
    sched.add_request([1, 2, 3], max_new_tokens=3)
    step = sched.next_step()
    sched.poison()
    sched.complete_step(step, [int(model(step.input_ids, step.position_ids, step.forward_metadata)[-1].argmax())])
    assert sched.null_blocks_poisoned() == {"FullAttention": True}
    step = sched.next_step()
    sched.poison()
    model(step.input_ids, step.position_ids, step.forward_metadata)
    # The two padding rows wrote into the null block.
    assert sched.null_blocks_poisoned() == {"FullAttention": False}


def test_stall_when_a_prompt_cannot_fit():
    model = ToyModel([ToyLayerSpec("FullAttention", block_size=4)])
    sched = Scheduler(model.get_cache_info(), max_model_len=16, max_concurrency=1,
                      block_num_by_key={"FullAttention": 3})
    sched.add_request(list(range(12)))  # needs 3 blocks, only 2 usable
    with pytest.raises(SchedulerStall):
        sched.next_step()
    with pytest.raises(ValueError):
        sched.add_request(list(range(17)))


def test_decode_defers_requests_that_cannot_grow():
    model = ToyModel([ToyLayerSpec("FullAttention", block_size=2)])
    # 4 usable blocks: two 3-token prompts take 2 each; the first decode crossing 4 tokens... needs more.
    sched = Scheduler(model.get_cache_info(), max_model_len=16, max_concurrency=2,
                      block_num_by_key={"FullAttention": 5})
    a = sched.add_request([1, 2, 3], max_new_tokens=5)
    b = sched.add_request([4, 5, 6], max_new_tokens=5)
    sched.complete_step(sched.next_step(), [7, 8])
    step = sched.next_step()  # positions 3: fits in the second block of each
    assert step.request_ids == [a, b] and step.deferred == []
    sched.complete_step(step, [1, 1])
    with pytest.raises(SchedulerStall):
        sched.next_step()  # position 4 needs a third block for both, none free


def test_graph_mode_lists_on_decode_only():
    model = ToyModel([ToyLayerSpec("FullAttention", block_size=4)])
    sched = Scheduler(model.get_cache_info(), max_model_len=16, max_concurrency=2, graph_mode_lists=True)
    sched.add_request([1, 2, 3])
    sched.add_request([4, 5])
    step = sched.next_step()
    assert step.forward_metadata.actual_seq_lengths_list_kv is None  # prefill: host lists stay None
    sched.complete_step(step, [6, 7])
    fm = sched.next_step().forward_metadata
    assert fm.actual_seq_lengths_list_kv == [4, 3] and fm.actual_seq_lengths_cu_list_q == [1, 2]
    assert fm.actual_seq_lengths_cu_list_kv == [4, 7] and fm.actual_seq_lengths_list_q == [1, 1]


def test_prefill_reading_back_from_the_cache():
    prompt = PROMPTS[2]  # 13 tokens
    # Full attention: every prompt position has storage, reading the cache back is exact.
    full = ToyModel([ToyLayerSpec("FullAttention", block_size=4)], prefill_reads_cache=True)
    sched = Scheduler(full.get_cache_info(), max_model_len=16, max_concurrency=1)
    sched.add_request(prompt)
    step = sched.next_step()
    sched.poison()
    logits = full(step.input_ids, step.position_ids, step.forward_metadata)
    assert torch.allclose(logits, full.reference_logits(prompt), atol=1e-6)
    # Sliding W=3, block 2: the layout gives storage only from token 10 (logical block 5); earlier
    # positions are written into, and read back from, the shared null block.
    sliding = ToyModel([ToyLayerSpec("SlidingWindow", sliding_window=3, block_size=2)], prefill_reads_cache=True)
    sched = Scheduler(sliding.get_cache_info(), max_model_len=16, max_concurrency=1)
    sched.add_request(prompt)
    step = sched.next_step()
    assert step.readable_positions["SlidingWindow"][0] == (10, 13)
    sched.poison()
    logits = sliding(step.input_ids, step.position_ids, step.forward_metadata)
    reference = sliding.reference_logits(prompt)
    assert sched.null_blocks_poisoned() == {"SlidingWindow": False}
    # Only the last query (12 reads 10..12) sees storage for its whole window; the others read
    # null-block slots that several positions overwrote (which write survives is not defined).
    assert torch.allclose(logits[12:], reference[12:], atol=1e-6)
    assert not torch.allclose(logits[:10], reference[:10], atol=1e-3)


@pytest.mark.parametrize("gen, decoded", [("G0", [0]), ("G1", [0, 2]), ("G3", [0, 2])])
def test_decode_admission_skips_a_request_that_cannot_grow_from_g1_on(gen, decoded):
    # 5 blocks of 4 tokens (4 usable besides the null block), all taken by the prefill:
    # request 0 (2 tokens) and request 2 (3 tokens) can decode within their block; request 1
    # (8 tokens, two full blocks) needs a third block and cannot grow.
    from model_infer_kvcache.validators.harness import get_generation

    g = get_generation(gen)
    kwargs = {"block_size": 4} if g.name in ("G2", "G3") else {}
    entries = [g.CacheEntry("k_cache", "FullAttention", 4, 1, torch.float32, True, tensor_setter=lambda t: None,
                            **kwargs)]
    layers = [g.LayerCacheInfo(0, entries)]
    info = g.ModelCacheInfo(1, layers) if g.name in ("G2", "G3") else g.ModelCacheInfo(1, 4, layers)
    sched = Scheduler(info, max_model_len=16, max_concurrency=3, generation=gen,
                      block_num_by_key={"FullAttention": 5})
    for prompt in ([2, 2], [1] * 8, [3, 3, 3]):
        sched.add_request(prompt, max_new_tokens=4)
    step = sched.next_step()
    assert step.is_prefill and step.request_ids == [0, 1, 2]
    sched.complete_step(step, [5, 5, 5])
    step = sched.next_step()
    assert not step.is_prefill
    assert step.request_ids == decoded  # G0 stops at request 1; later generations skip it
    assert 1 in step.deferred
