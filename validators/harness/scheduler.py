"""A small continuous-batching loop that feeds framework-mode models like the real engine does.

Per step it allocates blocks (``KVCacheManager.allocate_slots``), builds the packed TND
inputs and a ``ForwardMetaData`` the way the framework's execution engine does, and
records which blocks each request owns so validators can poison the rest in between.

Conventions taken from the framework (scheduler + execution engine):

* prefill: ``allocate_slots(rid, 0, L)``; ``position_ids = arange(L)`` per request;
  ``actual_seq_lengths_q = actual_seq_lengths_kv = L``; cumulative forms by cumsum;
  after the step the request's computed length (``kv_len``) is ``L - 1``;
* decode: ``allocate_slots(rid, computed + 1, 1)``; ``kv_len = computed + 1`` is both
  the write position and ``position_ids``; ``actual_seq_lengths_kv = kv_len + 1``
  (the first decode after a prefill of L reads L + 1); ``actual_seq_lengths_q`` = ones;
* prefill and decode are never mixed in one step; prefill goes first when it can;
* decode batches are padded to ``max_concurrency`` rows (the engine pads to
  ``batch_size_per_dp_rank``): pad token 0, position 0, KV length 1, and a block-table row
  of null blocks, so every padded row writes slot 0 of the null block
  (``pad_decode_to=0`` turns padding off; G0 is unpadded: its tables could not pad);
* a running request that cannot grow is skipped and the rest still decode (G1 on);
  G0 ends the decode batch at the first such request;
* ``attention_mask`` is the 2048x2048 ``~tril`` bool mask on every step;
* prefill ``kv_len`` is the framework's legacy per-token value
  (``slot * max_model_len + arange(L)``, meaningless for paged caches, kept for fidelity).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .api import FrameworkAPI
from .cache_utils import allocate_cache_tensors, calculate_block_num, validate_cache_info
from .entries import group_key_of
from .errors import SchedulerStall
from .managers import ATTN_TYPE_MANAGER_MAP_G3
from .poison import (
    assert_pool_invariants,
    block_is_poisoned,
    block_ownership,
    free_blocks,
    null_block_of,
    poison_free_blocks,
)

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


def _capturing(setter, captured: dict, key: str):
    def capture(tensor):
        captured.setdefault(key, []).append(tensor)
        setter(tensor)

    return capture


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int | None = None
    output_ids: list[int] = field(default_factory=list)
    # Framework meaning: position of the newest token whose K/V is in the cache.
    computed_len: int = 0
    status: str = WAITING
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose K/V are in the cache (0 before prefill)."""
        return 0 if self.status == WAITING else self.computed_len + 1

    def all_token_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.output_ids)


@dataclass
class Step:
    """One forward step as a model sees it, plus the ownership facts validators need."""

    index: int
    is_prefill: bool
    request_ids: list[int]
    input_ids: torch.Tensor  # [TotalTokens] (decode: one per row, padding rows included)
    position_ids: torch.Tensor  # [TotalTokens]
    forward_metadata: object
    q_lens: list[int]
    kv_lens: list[int]  # tokens each request's attention covers after this step's writes
    # group key -> request id -> real blocks the request owns during this step
    block_ownership: dict[str, dict[int, list[int]]]
    free_blocks: dict[str, list[int]]
    null_blocks: dict[str, int]
    # group key -> request id -> (first, end) positions that have storage this step
    readable_positions: dict[str, dict[int, tuple[int, int]]]
    deferred: list[int] = field(default_factory=list)
    padded_rows: int = 0

    def token_slices(self) -> dict[int, slice]:
        """Where each request's tokens sit in the packed inputs."""
        slices, start = {}, 0
        for rid, q_len in zip(self.request_ids, self.q_lens, strict=True):
            slices[rid] = slice(start, start + q_len)
            start += q_len
        return slices

    def last_token_rows(self) -> torch.Tensor:
        """Packed row of each request's last token (its logits predict the next token)."""
        ends = torch.tensor(self.q_lens, dtype=torch.long).cumsum(0)
        return ends - 1


def argmax_sampler(step: Step, logits: torch.Tensor) -> list[int]:
    """Greedy next token from ``logits [TotalTokens, vocab]`` at each request's last row."""
    rows = logits[step.last_token_rows().to(logits.device)]
    return [int(t) for t in rows.argmax(dim=-1).tolist()]


class Scheduler:
    """Admit, prefill, decode, finish: the request life cycle over a KVCacheManager.

    ``cache_info`` is what the model's ``get_cache_info()`` returns. ``api`` selects the
    framework implementation (default: the harness of ``generation``). Block counts
    default to the framework's offline math for ``max_model_len`` x ``max_concurrency``.
    """

    def __init__(
        self,
        cache_info,
        *,
        max_model_len: int,
        max_concurrency: int,
        api: FrameworkAPI | None = None,
        generation: str = "G2",
        block_num_by_key: dict[str, int] | None = None,
        extra_window_keys: int = 0,
        recycle_skipped_on_failure: bool = False,
        max_prefill_tokens: int | None = None,
        pad_decode_to: int | None = None,
        graph_mode_lists: bool = False,
        device: str | torch.device = "cpu",
        allocate_tensors: bool = True,
        fill_value: float | None = None,
        poison_value: float = float("nan"),
        next_n: int = 0,
    ):
        if api is None:
            api = FrameworkAPI.harness(
                generation, extra_window_keys=extra_window_keys, recycle_skipped_on_failure=recycle_skipped_on_failure
            )
        self.api = api
        self.cache_info = cache_info
        self.max_model_len = max_model_len
        self.max_concurrency = max_concurrency
        self.max_prefill_tokens = max_prefill_tokens
        # The real engine pads every decode batch to its per-DP-rank batch size (G1 on: G0's
        # prepare_block_tables could not build a padded batch, so G0 runs unpadded).
        if pad_decode_to is None:
            pad_decode_to = 0 if api.generation == "G0" else max_concurrency
        self.pad_decode_to = pad_decode_to
        self.graph_mode_lists = graph_mode_lists
        self.device = torch.device(device)
        self.poison_value = poison_value
        # the engine's model_config.next_n: sliding-window groups reserve 2 * next_n more tokens per request
        self.next_n = next_n

        # Which implementation did each framework step: "checkout" or "harness" (+ why).
        self.provenance: dict[str, str] = {}
        self._validate(cache_info)
        if block_num_by_key is None:
            block_num_by_key = self._block_counts(cache_info, max_model_len, max_concurrency)
        self.block_num_by_key = dict(block_num_by_key)
        self.kv_cache_manager = api.build_manager(cache_info, self.block_num_by_key, max_model_len)
        origin = "checkout" if api.real else "harness"
        for name in ("KVCacheManager", "create_single_type_managers", "prepare_block_tables",
                     "prepare_slot_mapping"):
            self.provenance[name] = origin
        self.cache_tensors: dict[str, list[torch.Tensor]] = {}
        if allocate_tensors:
            self.cache_tensors = self._allocate(cache_info, fill_value)

        self.requests: dict[int, Request] = {}
        self._waiting: list[int] = []
        self._running: list[int] = []
        self._next_id = 0
        self._prefilled_count = 0
        self._step_index = 0
        self._pending: Step | None = None

    # ---------------------------------------------------------------- framework steps
    def _from_checkout(self, name: str) -> bool:
        """True when the checkout provides ``name``; otherwise the harness's is used (and recorded)."""
        if not self.api.real:
            return False
        if hasattr(self.api.kv_cache, name):
            return True
        self.provenance[name] = f"harness (the checkout has no {name})"
        return False

    def _validate(self, cache_info) -> None:
        if self._from_checkout("validate_cache_info"):
            self.api.kv_cache.validate_cache_info(cache_info)
            self.provenance["validate_cache_info"] = "checkout"
            return
        validate_cache_info(cache_info, manager_map=ATTN_TYPE_MANAGER_MAP_G3 if self.api.generation == "G3" else None)
        self.provenance.setdefault("validate_cache_info", "harness")

    def _block_counts(self, cache_info, max_model_len: int, max_concurrency: int) -> dict[str, int]:
        if self._from_checkout("calculate_block_num"):
            # The checkout's own offline math (its memory check reads the stand-in torch.npu figures).
            infer_config = types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(batch_size_per_dp_rank=max_concurrency,
                                                       max_prefill_tokens=max_model_len, mem_fraction_static=0.9),
                model_config=types.SimpleNamespace(next_n=self.next_n),
                parallel_config=types.SimpleNamespace(offline_prefill_dp_group_size=1),
            )
            self.provenance["calculate_block_num"] = "checkout"
            return self.api.kv_cache.calculate_block_num(infer_config, cache_info, max_model_len)
        self.provenance.setdefault("calculate_block_num", "harness")
        return calculate_block_num(cache_info, max_concurrency=max_concurrency, offline_max_len=max_model_len,
                                   next_n=self.next_n)

    def _allocate(self, cache_info, fill_value) -> dict[str, list[torch.Tensor]]:
        if fill_value is None and self._from_checkout("allocate_cache_tensors"):
            captured: dict[str, list[torch.Tensor]] = {}
            originals = []
            for layer_info in cache_info.layer_infos:
                for entry in layer_info.caches:
                    if entry.needs_block and entry.tensor_setter is not None:
                        originals.append((entry, entry.tensor_setter))
                        entry.tensor_setter = _capturing(entry.tensor_setter, captured, group_key_of(entry))
            try:
                self.api.kv_cache.allocate_cache_tensors(self.device, cache_info, self.block_num_by_key)
                self.provenance["allocate_cache_tensors"] = "checkout"
                return captured
            except ImportError as exc:
                # G2+ aligns cache tensors through executor.utils / the KV-transfer buffer module, which
                # pull in the serving stack: they import on CPU under the device and third-party stand-ins
                # (what `validate --framework-root` installs); elsewhere the harness allocates the same shapes.
                self.provenance["allocate_cache_tensors"] = f"harness (checkout's needs {exc.name or exc})"
            finally:
                for entry, setter in originals:
                    entry.tensor_setter = setter
        self.provenance.setdefault("allocate_cache_tensors", "harness")
        return allocate_cache_tensors(self.device, cache_info, self.block_num_by_key, fill_value=fill_value)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None,
                    request_id: int | None = None) -> int:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_model_len={self.max_model_len}")
        if request_id is None:
            request_id = self._next_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} already used")
        self._next_id = max(self._next_id, request_id + 1)
        self.requests[request_id] = Request(request_id, prompt, max_new_tokens)
        self._waiting.append(request_id)
        return request_id

    def finish(self, request_id: int, reason: str = "aborted") -> None:
        """End a request now (waiting or running) and return its blocks to the pools."""
        if self._pending is not None and request_id in self._pending.request_ids:
            raise RuntimeError(f"request {request_id} is in the pending step; complete the step first")
        request = self.requests[request_id]
        if request.status == FINISHED:
            return
        if request.status == WAITING:
            self._waiting.remove(request_id)
        else:
            self._running.remove(request_id)
        self.kv_cache_manager.free(request_id)
        request.status, request.finish_reason = FINISHED, reason

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running_ids(self) -> list[int]:
        return list(self._running)

    @property
    def waiting_ids(self) -> list[int]:
        return list(self._waiting)

    # ---------------------------------------------------------------- stepping
    def next_step(self) -> Step | None:
        """Schedule and describe the next step; None when there is no work."""
        if self._pending is not None:
            raise RuntimeError("complete_step() the previous step first")
        if not self.has_work():
            return None
        step = self._try_prefill()
        if step is None and self._running:
            step = self._decode()
        if step is None:
            raise SchedulerStall(
                f"request {self._waiting[0]} cannot be admitted: usage {self.kv_cache_manager.format_usage()}"
            )
        self._pending = step
        self._step_index += 1
        return step

    def complete_step(self, step: Step, next_tokens: Sequence[int] | torch.Tensor) -> list[int]:
        """Record the sampled token of every request of ``step``; returns the ids that finished."""
        if step is not self._pending:
            raise RuntimeError("this step is not the pending one")
        tokens = [int(t) for t in (next_tokens.tolist() if isinstance(next_tokens, torch.Tensor) else next_tokens)]
        if len(tokens) != len(step.request_ids):
            raise ValueError(f"expected {len(step.request_ids)} next tokens, got {len(tokens)}")
        self._pending = None
        finished = []
        for rid, token in zip(step.request_ids, tokens, strict=True):
            request = self.requests[rid]
            if step.is_prefill:
                request.computed_len = request.prompt_len - 1
                request.status = RUNNING
                self._running.append(rid)
            else:
                request.computed_len += 1
            request.output_ids.append(token)
            reason = self._finish_reason(request)
            if reason:
                self.finish(rid, reason)
                finished.append(rid)
        return finished

    # ---------------------------------------------------------------- speculative decoding (MTP)
    def verify_step(self, drafts: dict[int, Sequence[int]]) -> Step:
        """A decode step that verifies draft tokens: per request its last token, then its drafts.

        Engine conventions with next_n > 0 (MTP worker): q_len = 1 + next_n tokens per request at
        positions ``computed + 1 .. computed + 1 + next_n``; ``kv_len`` is the last of them and
        ``actual_seq_lengths_kv = kv_len + 1``; ``allocate_slots(rid, computed + 1, 1 + next_n)``.
        """
        if self._pending is not None:
            raise RuntimeError("complete_step() the previous step first")
        rids = [rid for rid in self._running[: self.max_concurrency] if rid in drafts]
        widths = {len(drafts[rid]) for rid in rids}
        if not rids or len(widths) != 1 or 0 in widths:
            raise ValueError(f"verify_step needs the same number (> 0) of drafts per running request, got {drafts}")
        next_n = widths.pop()
        for rid in rids:
            if not self.kv_cache_manager.allocate_slots(rid, self.requests[rid].computed_len + 1, 1 + next_n):
                raise SchedulerStall(f"request {rid} cannot grow by {1 + next_n}: {self.kv_cache_manager.format_usage()}")
        requests = [self.requests[r] for r in rids]
        q_len = 1 + next_n
        rows = max(len(rids), self.pad_decode_to or 0)
        pad = rows - len(rids)
        # Padding rows q_len tokens each: token 0 at positions 0 .. next_n (KV length q_len), on the null block.
        # (execution_engine.py pads a verify batch at position 0 with kv_len 0: KV length 1 under q_len 1 + next_n,
        # which FA's packed-layout rule for sparse_mode 3 rejects, q_len <= KV length; here the rows stay legal.)
        tokens = [t for r in requests for t in (r.output_ids[-1], *drafts[r.request_id])] + [0] * (pad * q_len)
        positions = [r.computed_len + 1 + i for r in requests for i in range(q_len)] + list(range(q_len)) * pad
        kv_len = self._long([r.computed_len + 1 + next_n for r in requests] + [next_n] * pad)
        seq_kv = kv_len + 1
        seq_q = torch.full((rows,), q_len, dtype=torch.long, device=self.device)
        step = self._assemble(
            rids, requests, is_prefill=False, input_ids=self._long(tokens), position_ids=self._long(positions),
            q_lens=[q_len] * len(rids), kv_lens=seq_kv[: len(rids)].tolist(), kv_len=kv_len, batch_rows=rows,
            prompt_tokens=0, cu_q=seq_q.cumsum(0), cu_kv=seq_kv.cumsum(0), seq_q=seq_q, seq_kv=seq_kv,
            padded_rows=pad,
        )
        self._pending = step
        self._step_index += 1
        return step

    def complete_verify(self, step: Step, emitted: Sequence[Sequence[int]]) -> list[int]:
        """Record a verify step: per request the accepted drafts, then the model's next token.

        The cache now holds each request's tokens up to its last accepted one (computed_len
        advances by ``len(emitted)``); slots of rejected drafts stay allocated and are overwritten
        by the next step. Returns the ids that finished.
        """
        if step is not self._pending:
            raise RuntimeError("this step is not the pending one")
        if len(emitted) != len(step.request_ids) or \
                any(not 1 <= len(e) <= q for e, q in zip(emitted, step.q_lens, strict=True)):
            raise ValueError(f"expected 1..q_len tokens for each of {len(step.request_ids)} requests, got {emitted}")
        self._pending = None
        finished = []
        for rid, tokens in zip(step.request_ids, emitted, strict=True):
            request = self.requests[rid]
            request.computed_len += len(tokens)
            request.output_ids.extend(int(t) for t in tokens)
            reason = self._finish_reason(request)
            if reason:
                self.finish(rid, reason)
                finished.append(rid)
        return finished

    def _finish_reason(self, request: Request) -> str | None:
        if request.max_new_tokens is not None and len(request.output_ids) >= request.max_new_tokens:
            return "length"
        # The next decode would write position computed_len + 1.
        if request.computed_len + 2 > self.max_model_len:
            return "max_model_len"
        return None

    def _try_prefill(self) -> Step | None:
        selected: list[int] = []
        tokens = 0
        while self._waiting and len(self._running) + len(selected) < self.max_concurrency:
            rid = self._waiting[0]
            length = self.requests[rid].prompt_len
            if self.max_prefill_tokens is not None and selected and tokens + length > self.max_prefill_tokens:
                break
            if not self.kv_cache_manager.allocate_slots(rid, 0, length):
                break
            selected.append(self._waiting.pop(0))
            tokens += length
        if not selected:
            return None
        return self._build_prefill(selected)

    def _decode(self) -> Step | None:
        selected, deferred = [], []
        stop_at_first = self.api.decode_admission == "stop"
        for rid in self._running[: self.max_concurrency]:
            request = self.requests[rid]
            if (deferred and stop_at_first) or not self.kv_cache_manager.allocate_slots(
                    rid, request.computed_len + 1, 1):
                # G0 stops at the first request that cannot grow; later generations skip it.
                deferred.append(rid)
                continue
            selected.append(rid)
        if not selected:
            raise SchedulerStall(f"no running request can grow: usage {self.kv_cache_manager.format_usage()}")
        step = self._build_decode(selected)
        step.deferred = deferred
        return step

    # ---------------------------------------------------------------- step assembly
    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _build_prefill(self, rids: list[int]) -> Step:
        requests = [self.requests[r] for r in rids]
        lengths = [r.prompt_len for r in requests]
        input_ids = self._long([t for r in requests for t in r.prompt_ids])
        position_ids = torch.cat([torch.arange(n, dtype=torch.long, device=self.device) for n in lengths])
        seq = self._long(lengths)
        cu = seq.cumsum(0)
        legacy_kv_len = torch.cat([
            torch.arange(n, dtype=torch.long, device=self.device) + (self._prefilled_count + i) * self.max_model_len
            for i, n in enumerate(lengths)
        ])
        self._prefilled_count += len(rids)
        return self._assemble(
            rids, requests, is_prefill=True, input_ids=input_ids, position_ids=position_ids,
            q_lens=lengths, kv_lens=lengths, kv_len=legacy_kv_len, batch_rows=len(rids),
            prompt_tokens=sum(lengths), cu_q=cu, cu_kv=cu.clone(), seq_q=seq, seq_kv=seq.clone(),
        )

    def _build_decode(self, rids: list[int]) -> Step:
        requests = [self.requests[r] for r in rids]
        rows = max(len(rids), self.pad_decode_to or 0)
        pad = rows - len(rids)
        # Padding rows carry token 0 at position 0 (kv length 1), as the engine pads.
        tokens = [r.output_ids[-1] for r in requests] + [0] * pad
        positions = [r.computed_len + 1 for r in requests] + [0] * pad
        kv_len = self._long(positions)
        seq_kv = kv_len + 1
        seq_q = torch.ones(rows, dtype=torch.long, device=self.device)
        return self._assemble(
            rids, requests, is_prefill=False, input_ids=self._long(tokens), position_ids=kv_len.clone(),
            q_lens=[1] * len(rids), kv_lens=[p + 1 for p in positions[: len(rids)]], kv_len=kv_len,
            batch_rows=rows, prompt_tokens=0, cu_q=seq_q.cumsum(0), cu_kv=seq_kv.cumsum(0),
            seq_q=seq_q, seq_kv=seq_kv, padded_rows=pad,
        )

    def _assemble(self, rids, requests, *, is_prefill, input_ids, position_ids, q_lens, kv_lens, kv_len,
                  batch_rows, prompt_tokens, cu_q, cu_kv, seq_q, seq_kv, padded_rows=0) -> Step:
        manager = self.kv_cache_manager
        tables = self.api.block_tables(requests, manager, self.max_model_len, self.device, batch_rows,
                                       is_prefill=is_prefill)
        slots = self.api.slot_mappings(position_ids, cu_q, manager, tables)
        lists = {}
        if self.graph_mode_lists and not is_prefill:
            lists = {
                "actual_seq_lengths_cu_list_kv": cu_kv.tolist(),
                "actual_seq_lengths_cu_list_q": cu_q.tolist(),
                "actual_seq_lengths_list_kv": seq_kv.tolist(),
                "actual_seq_lengths_list_q": seq_q.tolist(),
            }
        metadata = self.api.publish_forward_metadata(
            is_prefill=is_prefill,
            attention_mask=self.api.attention_mask(self.device),
            kv_len=kv_len,
            actual_seq_lengths_kv=seq_kv,
            actual_seq_lengths_q=seq_q,
            actual_seq_lengths_cu_kv=cu_kv,
            actual_seq_lengths_cu_q=cu_q,
            actual_seq_lengths_cu_list_kv=lists.get("actual_seq_lengths_cu_list_kv"),
            actual_seq_lengths_cu_list_q=lists.get("actual_seq_lengths_cu_list_q"),
            actual_seq_lengths_list_kv=lists.get("actual_seq_lengths_list_kv"),
            actual_seq_lengths_list_q=lists.get("actual_seq_lengths_list_q"),
            prompt_tokens=prompt_tokens,
            block_table=tables,
            slot_mapping=slots,
        )
        ownership = block_ownership(manager)
        live = set(rids)
        return Step(
            index=self._step_index,
            is_prefill=is_prefill,
            request_ids=list(rids),
            input_ids=input_ids,
            position_ids=position_ids,
            forward_metadata=metadata,
            q_lens=list(q_lens),
            kv_lens=list(kv_lens),
            block_ownership={k: {r: b for r, b in owners.items() if r in live} for k, owners in ownership.items()},
            free_blocks={FrameworkAPI.table_key(m): free_blocks(m) for m in manager.single_type_managers},
            null_blocks={FrameworkAPI.table_key(m): null_block_of(m) for m in manager.single_type_managers},
            readable_positions=self._readable(rids, kv_lens),
            padded_rows=padded_rows,
        )

    def _readable(self, rids, kv_lens) -> dict[str, dict[int, tuple[int, int]]]:
        out: dict[str, dict[int, tuple[int, int]]] = {}
        for m in self.kv_cache_manager.single_type_managers:
            null = null_block_of(m)
            per_request = {}
            for rid, length in zip(rids, kv_lens, strict=True):
                blocks = m.req_to_blocks.get(rid, [])
                first_real = next((i for i, b in enumerate(blocks) if b != null), None)
                start = length if first_real is None else min(first_real * m.block_size, length)
                per_request[rid] = (start, length)
            out[FrameworkAPI.table_key(m)] = per_request
        return out

    # ---------------------------------------------------------------- poisoning & checks
    def poison(self, value: float | None = None, *, include_null: bool = True) -> dict[str, list[int]]:
        """Fill every block no request owns (and the null blocks) in all cache tensors."""
        value = self.poison_value if value is None else value
        return poison_free_blocks(self.kv_cache_manager, self.cache_tensors, value, include_null=include_null)

    def null_blocks_poisoned(self, value: float | None = None) -> dict[str, bool]:
        """After a forward: True per group when the null block still holds only poison.

        False means the step wrote into the null block (e.g. slot mappings of padded decode
        rows, or of sliding-window prefill positions outside the window).
        """
        value = self.poison_value if value is None else value
        result = {}
        for m in self.kv_cache_manager.single_type_managers:
            key = FrameworkAPI.table_key(m)
            result[key] = all(block_is_poisoned(t, null_block_of(m), value) for t in self.cache_tensors.get(key, []))
        return result

    def check_invariants(self) -> None:
        assert_pool_invariants(self.kv_cache_manager)

    def usage(self) -> dict[str, dict[str, int]]:
        return {
            FrameworkAPI.table_key(m): {
                "total": m.block_pool.num_blocks,
                "free": m.get_num_free_blocks(),
                "used": m.block_pool.num_blocks - 1 - m.get_num_free_blocks(),
            }
            for m in self.kv_cache_manager.single_type_managers
        }

    # ---------------------------------------------------------------- driver
    def run(
        self,
        model: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor],
        *,
        sampler: Callable[[Step, torch.Tensor], Sequence[int]] = argmax_sampler,
        poison: bool = False,
        on_step: Callable[[Scheduler, Step, torch.Tensor], None] | None = None,
        max_steps: int = 100_000,
    ) -> dict[int, list[int]]:
        """Drive ``model(input_ids, position_ids, forward_metadata)`` until no work is left.

        ``poison=True`` poisons unowned and null blocks before every forward. ``on_step``
        runs after each completed step (it may add or finish requests). Returns the
        generated tokens per request id.
        """
        for _ in range(max_steps):
            step = self.next_step()
            if step is None:
                break
            if poison:
                self.poison()
            output = model(step.input_ids, step.position_ids, step.forward_metadata)
            self.complete_step(step, sampler(step, output))
            if on_step is not None:
                on_step(self, step, output)
        else:
            raise RuntimeError(f"still running after {max_steps} steps")
        return {rid: list(r.output_ids) for rid, r in self.requests.items()}


__all__ = ["FINISHED", "RUNNING", "WAITING", "Request", "Scheduler", "Step", "argmax_sampler"]
