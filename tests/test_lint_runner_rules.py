"""KV902-KV904 (a standalone runner's own slots, cache and lengths): where they fire, and the correct code
next to each pattern that must stay silent. The paired fixtures (tests/fixtures/lint/kv90*) are run by
test_lint_rules.py; these are the near misses that decide how narrow each rule is."""

from __future__ import annotations

import textwrap

import pytest
from model_infer_kvcache.validators.lint import lint_source

RUNNER_HEAD = '''\
import heapq
from collections import deque

import torch


class ServingRunner:
    def __init__(self, model, max_batch, device):
        self.model = model
        self.kv_len = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.free_slots = list(range(max_batch))

    def admit(self, request):
        request.slot = self.free_slots.pop()
        return request.slot
'''


def _rules(source: str, rule: str) -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in lint_source(textwrap.dedent(source), path="<runner>", select=rule)]


def _runner(body: str, head: str = RUNNER_HEAD) -> str:
    return head + textwrap.indent(textwrap.dedent(body), "    ")


# ---------------------------------------------------------------- KV902


GROW_AND_FREE = '''
def step(self, slots, input_ids):
    logits = self.model(input_ids, kv_len=self.kv_len[slots])
    self.kv_len[slots] += 1
    return logits

def finish(self, request):
    self.free_slots.append(request.slot)
'''


def test_kv902_fires_at_the_slot_handed_out():
    assert _rules(_runner(GROW_AND_FREE), "KV902") == [("KV902", 14)]


@pytest.mark.parametrize("body", [
    # the length is reset when the slot comes back
    GROW_AND_FREE + "\ndef release(self, slot):\n    self.kv_len[slot].zero_()\n",
    # ... or set to the prompt length at prefill
    GROW_AND_FREE + "\ndef prefill(self, slot, prompt_ids):\n    self.kv_len[slot] = len(prompt_ids)\n",
    # ... or the whole tensor is rebuilt between batches
    GROW_AND_FREE + "\ndef reset(self):\n    self.kv_len = torch.zeros_like(self.kv_len)\n",
    # the whole tensor goes to the model, which may reset rows itself: not visible here
    GROW_AND_FREE.replace("kv_len=self.kv_len[slots]", "kv_len=self.kv_len"),
    # slots are never given back: a static batch, nothing is reused
    GROW_AND_FREE.replace("self.free_slots.append(request.slot)", "self.done.add(request.slot)"),
    # the length lives on the request, not on the slot
    GROW_AND_FREE.replace("self.kv_len[slots] += 1", "for request in self.running:\n        request.kv_len += 1"),
], ids=["zero_", "prompt-length", "rebuilt", "whole-tensor-to-model", "never-freed", "per-request"])
def test_kv902_silent_on_correct_or_unjudgeable_code(body):
    assert _rules(_runner(body), "KV902") == []


def test_kv902_counts_an_init_helper_as_init_and_any_other_reallocation_as_a_reset():
    head = RUNNER_HEAD.replace("        self.kv_len = torch.zeros(max_batch, dtype=torch.int64, device=device)\n",
                               "        self._init_lengths(max_batch, device)\n")
    init_helper = GROW_AND_FREE + (
        "\ndef _init_lengths(self, max_batch, device):\n"
        "    self.kv_len = torch.zeros(max_batch, dtype=torch.int64, device=device)\n")
    assert _rules(_runner(init_helper, head), "KV902") == [("KV902", 14)]
    called_per_batch = init_helper + "\ndef new_batch(self, max_batch, device):\n    self._init_lengths(max_batch, device)\n"
    assert _rules(_runner(called_per_batch, head), "KV902") == []


def test_kv902_host_list_lengths_and_a_heap_pool():
    head = RUNNER_HEAD.replace("self.kv_len = torch.zeros(max_batch, dtype=torch.int64, device=device)",
                               "self.seq_lens = [0] * max_batch").replace(
        "self.free_slots = list(range(max_batch))", "self.free_slots = [i for i in range(max_batch)]").replace(
        "request.slot = self.free_slots.pop()", "request.slot = heapq.heappop(self.free_slots)")
    body = '''
    def step(self, slots, input_ids):
        for slot in slots:
            self.seq_lens[slot] += 1
        return self.model(input_ids, [self.seq_lens[s] for s in slots])

    def finish(self, request):
        heapq.heappush(self.free_slots, request.slot)
    '''
    assert _rules(_runner(body, head), "KV902") == [("KV902", 14)]


# ---------------------------------------------------------------- KV903


def _per_step(body: str) -> str:
    return "import torch\n\n\nclass Runner:\n" + textwrap.indent(textwrap.dedent(body), "    ")


@pytest.mark.parametrize("body", [
    '''
    def forward(self, input_ids, kv_len):
        past_key_values = DynamicCache()
        return self.model(input_ids, past_key_values=past_key_values, kv_len=kv_len)
    ''',
    '''
    def generate(self, input_ids, max_new_tokens):
        while input_ids.shape[1] < max_new_tokens:
            for layer in self.model.layers:
                layer.k_cache = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            input_ids = self.model(input_ids)
    ''',
], ids=["forward-dynamic-cache", "layer-loop-inside-token-loop"])
def test_kv903_fires(body):
    assert [rule for rule, _ in _rules(_per_step(body), "KV903")] == ["KV903"]


@pytest.mark.parametrize("body", [
    # once, at construction / in the init method
    '''
    def __init__(self, shape, device):
        self.k_cache = torch.zeros(shape, device=device)

    def _init_kvcache(self, modules, shape, device):
        for attn in modules:
            attn.k_cache = torch.zeros(shape, device=device)
    ''',
    # lazily, on the first step only (transformers' forward too)
    '''
    def forward(self, input_ids, past_key_values=None, use_cache=True):
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        return self.model(input_ids, past_key_values=past_key_values)
    ''',
    # once per batch, at prefill
    '''
    def step(self, input_ids, is_prefill):
        if is_prefill:
            self.k_cache = torch.zeros(self.shape, device=self.device)
        return self.model(input_ids, self.k_cache)
    ''',
    # a rotary cos/sin cache is no KV cache
    '''
    def forward(self, x, seq_len):
        cos_sin_cache = torch.zeros(seq_len, self.dim, device=x.device)
        return cos_sin_cache
    ''',
    # per layer, before the token loop: once per generate call
    '''
    def generate(self, input_ids, max_new_tokens):
        for layer in self.model.layers:
            layer.k_cache = torch.zeros(self.shape, device=self.device)
        for _ in range(max_new_tokens):
            input_ids = self.model(input_ids)
        return input_ids
    ''',
], ids=["init", "lazy", "prefill-branch", "rotary", "layers-before-loop"])
def test_kv903_silent(body):
    assert _rules(_per_step(body), "KV903") == []


# ---------------------------------------------------------------- KV904


PAGED_HEAD = '''\
import torch


class PagedRunner:
    def __init__(self, batch_size, max_seq_len, device):
        self.kv_len_offset = torch.arange(0, batch_size * max_seq_len, max_seq_len, device=device)
        self.kv_len = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.seq_lens = [0] * batch_size

    def _slots(self, rows):
        index = torch.as_tensor(rows, device=self.kv_len.device)
        return self.kv_len[index] + self.kv_len_offset[index]
'''


@pytest.mark.parametrize("body", [
    # a dict of step inputs, the slots through a helper of the runner
    '''
    def inputs(self, rows, input_ids):
        lengths = [self.seq_lens[row] + 1 for row in rows]
        return {"input_ids": input_ids, "actual_seq_lengths_kv": lengths, "slot_mapping": self._slots(rows)}
    ''',
    # a second device counter brought to the host
    '''
    def metadata(self, rows):
        index = torch.as_tensor(rows, device=self.kv_len.device)
        return ForwardMetaData(actual_seq_lengths_kv=(self.cache_lens[index] + 1).tolist(),
                               slot_mapping=self._slots(rows))
    ''',
], ids=["dict-and-helper", "other-device-counter-tolist"])
def test_kv904_fires(body):
    assert [rule for rule, _ in _rules(_runner(body, PAGED_HEAD), "KV904")] == ["KV904"]


@pytest.mark.parametrize("body", [
    # one counter, brought to the host for FA v1
    '''
    def metadata(self, rows):
        index = torch.as_tensor(rows, device=self.kv_len.device)
        return ForwardMetaData(actual_seq_lengths_kv=(self.kv_len[index] + 1).tolist(),
                               slot_mapping=self._slots(rows))
    ''',
    # lengths passed in by the caller: where they come from is not visible
    '''
    def metadata(self, rows, kv_lens):
        return ForwardMetaData(actual_seq_lengths_kv=list(kv_lens), slot_mapping=self._slots(rows))
    ''',
    # slots passed in by the caller
    '''
    def metadata(self, rows, slot_mapping):
        return ForwardMetaData(actual_seq_lengths_kv=[self.seq_lens[r] for r in rows], slot_mapping=slot_mapping)
    ''',
    # device lengths from another counter: not host-side (two device counters are out of this rule's scope)
    '''
    def metadata(self, rows):
        index = torch.as_tensor(rows, device=self.kv_len.device)
        return ForwardMetaData(actual_seq_lengths_kv=self.cache_lens[index] + 1, slot_mapping=self._slots(rows))
    ''',
], ids=["same-counter", "lengths-parameter", "slots-parameter", "device-lengths"])
def test_kv904_silent(body):
    assert _rules(_runner(body, PAGED_HEAD), "KV904") == []


SERVING_LOOP = '''\
class Runner:
    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.row_len = [0] * batch_size

    def generate(self, requests):
        free_rows = list(range(self.batch_size))
        running = {}
        while requests or running:
            while requests and free_rows:
                row = free_rows.pop(0)
                running[row] = requests.pop()
            for row in sorted(running):
                self.row_len[row] += 1
            for row in [r for r, q in running.items() if q.done]:
                self._finish(row, running, free_rows)

    def _finish(self, row, running, free_rows):
        del running[row]
        self.row_len[row] = 0
        free_rows.append(row)
'''


def test_kv902_follows_a_serving_loops_own_free_list_into_its_helpers():
    """The free list a serving loop keeps in a local (handed to its finish helper by name) and a per-row length:
    the migrated pangu runner's shape (examples/pangu_7b_standalone). Its finish helper resets the row's length;
    without that line the rule fires at the row handed out."""
    assert _rules(SERVING_LOOP, "KV902") == []
    assert _rules(SERVING_LOOP.replace("        self.row_len[row] = 0\n", ""), "KV902") == [("KV902", 11)]
