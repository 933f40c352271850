"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention): ``npu_recurrent_gated_delta_rule`` (decode, MTP) and
``npu_chunk_gated_delta_rule`` (prefill; torch-npu 2.14.0 only).

Doc (torch-npu 2.9.0 and 2.14.0 ``_op_plugin_docs.py``, the recurrent entries identical; the chunk entry 2.14.0):
tokens are packed over requests (``T = sum L_i``, ``actual_seq_lengths`` the per-request lengths ``L_i``, int32
``(B,)``); query/key ``(T, Nk, Dk)``, value ``(T, Nv, Dv)``, beta ``(T, Nv)``, all bfloat16; g ``(T, Nv)``
float32 with ``alpha = e^g`` (None: all 0); the state ``(BlockNum, Nv, Dv, Dk)`` bfloat16 -- value-major,
the transpose of transformers' ``[B, Nv, Dk, Dv]``; output ``(T, Nv, Dv)`` bfloat16. Per value head h and
token, on the state S (``[Dv, Dk]``)::

    S <- S * exp(g);  delta = beta * (v - S k);  S <- S + delta k^T;  o = S (scale * q)

which is transformers' ``torch_recurrent_gated_delta_rule`` with the state transposed and ``scale`` given by the
caller. The op does not l2-normalize q and k: both docs' examples normalize them before the call
(``torch.nn.functional.normalize(query, p=2, dim=-1)``), as upstream qwen3_5 does; transformers does it inside
only under ``use_qk_l2norm_in_kernel``.

``npu_recurrent_gated_delta_rule`` updates ``state`` in place (schema ``Tensor(a!) state``) and returns ``o``.
``ssm_state_indices`` is int32 ``(T,)`` -- "state[ssm_state_indices[i]] is token i's state matrix" -- so each
token names a slot. Documented limits: ``L_i <= 8``, ``Nk, Nv, Dk, Dv <= 256``. ``num_accepted_tokens``
(int32 ``(B,)``, None: 1 each) is MTP's accepted count per request.

``npu_chunk_gated_delta_rule`` has no index argument: request b starts from ``initial_state[b]`` (so
``BlockNum`` must equal B; the doc's example and upstream qwen3_5 pass one state per request) and the final
states come back as the second output, shaped and typed like ``initial_state``; ``initial_state`` itself is
not written (the schema does not mark it ``(a!)``; upstream copies the returned state). Documented limits:
``Nk, Nv <= 64``, ``Dk = Dv = 128``, ``Nv`` a multiple of ``Nk``. The entry also repeats the recurrent op's
``L_i <= 8``, which its own example (``seqlen = 100``) and purpose (prefill, long contexts) contradict, so it
is not enforced (references/emulated_ops.md).

Open behaviours, explicit switches (references/device_questions.md): ``gdr_state_writes`` (every token's
state written, or only the last), ``gdr_accepted_start`` (the slot a request starts from under
``num_accepted_tokens``), ``gdr_head_grouping`` (which key head serves value head h when Nv > Nk).

Fixed rules: every input is required where the doc says so (``beta``, ``scale``, ``actual_seq_lengths``,
``ssm_state_indices``, ``initial_state``); ``sum L_i == T``; a slot two requests share (they race on it) ends
NaN, undefined -- the framework's padded decode rows all share the null block; ``gk`` (documented as not supported yet) is refused as not emulated. Dtypes: bfloat16 as
documented; float32 (a checkout run's comparison dtype: a model's bfloat16 casts for these operators run in
float32 there); or float64 throughout (the CPU validation mode; g may then be float64 too).
"""

from __future__ import annotations

import torch

# the documented limits (L_i <= 8, Nk, Nv, Dk, Dv <= 256; chunk: Nk, Nv <= 64, Dk = Dv = 128), one home
from model_infer_kvcache.analyzer.operators.gdr_facts import (
    CHUNK_HEAD_DIM,
    CHUNK_MAX_HEADS,
    RECURRENT_MAX_LEN,
    RECURRENT_MAX_SIZE,
)
from model_infer_kvcache.validators.npu_ops import op_checks as chk
from model_infer_kvcache.validators.npu_ops.errors import NpuOpError, UnemulatedFeatureError
from model_infer_kvcache.validators.npu_ops.readings import consult

RECURRENT = "npu_recurrent_gated_delta_rule"
CHUNK = "npu_chunk_gated_delta_rule"
# bfloat16: the documented dtype; float32: a checkout run's comparison dtype; float64: the CPU validation mode
# (emulated.py). Neither float32 nor float64 is a device dtype of these operators.
DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def _required(op: str, **values) -> None:
    for name, value in values.items():
        if value is None:
            raise NpuOpError(op, name, "is required (the doc lists it as 必选输入)")


def _qkv(op: str, query, key, value, max_heads: int) -> tuple[int, int, int, int, int]:
    """``(T, Nk, Nv, Dk, Dv)`` after the rank / dtype / shape checks of query, key and value."""
    chk.tensor(op, "query", query, dims=(3,), dtypes=DTYPES)
    chk.tensor(op, "key", key, dims=(3,))
    chk.same_dtype(op, "key", key, "query", query)
    chk.tensor(op, "value", value, dims=(3,))
    chk.same_dtype(op, "value", value, "query", query)
    if tuple(key.shape) != tuple(query.shape):
        raise NpuOpError(op, "key", f"shape {tuple(key.shape)} must equal the query's {tuple(query.shape)} "
                                    "((T, Nk, Dk))")
    tokens, nk, dk = query.shape
    if value.shape[0] != tokens:
        raise NpuOpError(op, "value", f"has {value.shape[0]} tokens, the query {tokens}")
    nv, dv = value.shape[1], value.shape[2]
    for name, size, what in (("query", nk, "Nk"), ("value", nv, "Nv")):
        if not 1 <= size <= max_heads:
            raise NpuOpError(op, name, f"{what} {size} is outside the documented 1..{max_heads}")
    if nv % nk:
        raise NpuOpError(op, "value", f"Nv {nv} must be a multiple of the query/key heads Nk {nk}")
    return tokens, nk, nv, dk, dv


def _lengths(op: str, lengths, batch_name: str, tokens: int) -> list[int]:
    t = chk.tensor(op, "actual_seq_lengths", lengths, dims=(1,), dtypes=(torch.int32,))
    vals = [int(v) for v in t.tolist()]
    if any(v < 0 for v in vals):
        raise NpuOpError(op, "actual_seq_lengths", f"holds a negative length: {vals}")
    if sum(vals) != tokens:
        raise NpuOpError(op, "actual_seq_lengths", f"per-request lengths {vals} sum to {sum(vals)}, not the "
                                                   f"{tokens} tokens of {batch_name} (T = sum L_i)")
    return vals


def _per_head(op: str, name: str, t, tokens: int, nv: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    chk.tensor(op, name, t, dims=(2,), dtypes=dtypes)
    if tuple(t.shape) != (tokens, nv):
        raise NpuOpError(op, name, f"shape {tuple(t.shape)} must be (T, Nv) = {(tokens, nv)}")
    return t


def _gate(op: str, g, tokens: int, nv: int, dtype: torch.dtype) -> torch.Tensor | None:
    if g is None:
        return None  # doc: None means all 0 (no decay)
    allowed = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    return _per_head(op, "g", g, tokens, nv, allowed)


def _scale(op: str, scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise NpuOpError(op, "scale", f"must be a float, got {type(scale).__name__}")
    return float(scale)


def _state(op: str, name: str, t, nv: int, dv: int, dk: int, dtype: torch.dtype) -> torch.Tensor:
    chk.tensor(op, name, t, dims=(4,))
    if t.dtype != dtype:
        raise NpuOpError(op, name, f"dtype {t.dtype} must equal the query's {dtype}")
    if tuple(t.shape[1:]) != (nv, dv, dk):
        hint = (" (it is [.., Nv, Dk, Dv], transformers' layout: transpose the last two axes)"
                if tuple(t.shape[1:]) == (nv, dk, dv) else "")
        raise NpuOpError(op, name, f"shape {tuple(t.shape)} must be (BlockNum, Nv, Dv, Dk) = "
                                   f"(BlockNum, {nv}, {dv}, {dk}){hint}")
    return t


def key_head_of(nk: int, nv: int) -> torch.Tensor:
    """``[Nv]`` long: the query/key head serving each value head, under the ``gdr_head_grouping`` reading."""
    group = nv // nk
    heads = torch.arange(nv)
    if group == 1:
        return heads  # one key head per value head: the readings agree, nothing to consult
    if consult("gdr_head_grouping") == "strided":
        return heads % nk
    return heads // group


def _compute_inputs(query, key, value, beta, g, nk: int, nv: int):
    """Both ops' inputs in the compute dtype, q/k expanded to the value heads they serve (gdr_head_grouping), and
    a zero output ``(T, Nv, Dv)``: ``(q, k, v, beta, g, out)``."""
    cdt = chk.compute_dtype(query.dtype)
    heads = key_head_of(nk, nv)
    q, k = (t.to(cdt)[:, heads] for t in (query, key))
    gt = g.to(cdt) if g is not None else None
    return q, k, value.to(cdt), beta.to(cdt), gt, torch.zeros(value.shape, dtype=cdt)


def _run(q, k, v, beta, g, scale: float, state: torch.Tensor, on_token=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q/k ``[L, Nv, Dk]`` (already expanded to value heads), v ``[L, Nv, Dv]``, beta/g ``[L, Nv]``,
    state ``[Nv, Dv, Dk]``, all in the compute dtype; ``(o [L, Nv, Dv], final state)``. ``on_token(i, S)``
    sees the state after token i."""
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        if g is not None:
            state = state * g[i].exp().view(-1, 1, 1)
        kv_mem = torch.einsum("hvk,hk->hv", state, k[i])
        delta = (v[i] - kv_mem) * beta[i].unsqueeze(-1)
        state = state + delta.unsqueeze(-1) * k[i].unsqueeze(-2)
        out[i] = torch.einsum("hvk,hk->hv", state, q[i] * scale)
        if on_token is not None:
            on_token(i, state)
    return out, state


def npu_recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None, actual_seq_lengths=None,
                                   ssm_state_indices=None, num_accepted_tokens=None, g=None, gk=None):
    """``o`` ``(T, Nv, Dv)``; ``state`` is updated in place through ``ssm_state_indices`` (module docstring)."""
    op = RECURRENT
    if gk is not None:
        raise UnemulatedFeatureError(op, "gk", "the per-key-dim gate is documented as not supported by the current "
                                               "version (传None即可) and is not emulated")
    _required(op, beta=beta, scale=scale, actual_seq_lengths=actual_seq_lengths, ssm_state_indices=ssm_state_indices)
    tokens, nk, nv, dk, dv = _qkv(op, query, key, value, RECURRENT_MAX_SIZE)
    for name, size in (("Dk", dk), ("Dv", dv)):
        if not 1 <= size <= RECURRENT_MAX_SIZE:
            raise NpuOpError(op, "query" if name == "Dk" else "value",
                             f"{name} {size} is outside the documented 1..{RECURRENT_MAX_SIZE}")
    scale = _scale(op, scale)
    lens = _lengths(op, actual_seq_lengths, "query", tokens)
    too_long = [n for n in lens if n > RECURRENT_MAX_LEN]
    if too_long:
        raise NpuOpError(op, "actual_seq_lengths", f"a request of {too_long[0]} tokens exceeds the documented "
                                                   f"L_i <= {RECURRENT_MAX_LEN} (prefill: npu_chunk_gated_delta_rule)")
    _state(op, "state", state, nv, dv, dk, query.dtype)
    _per_head(op, "beta", beta, tokens, nv, (query.dtype,))
    g = _gate(op, g, tokens, nv, query.dtype)
    idx_t = chk.tensor(op, "ssm_state_indices", ssm_state_indices, dims=(1,), dtypes=(torch.int32,))
    if idx_t.shape[0] != tokens:
        raise NpuOpError(op, "ssm_state_indices", f"has {idx_t.shape[0]} entries; the doc's shape is (T,) = "
                                                  f"({tokens},), one slot per token")
    slots = [int(s) for s in idx_t.tolist()]
    bad = [s for s in slots if not 0 <= s < state.shape[0]]
    if bad:
        raise NpuOpError(op, "ssm_state_indices", f"slot {bad[0]} is outside state's {state.shape[0]} blocks")
    starts = [sum(lens[:b]) for b in range(len(lens))]
    accepted = [1] * len(lens)  # doc: None means one accepted token per request
    if num_accepted_tokens is not None:
        acc_t = chk.tensor(op, "num_accepted_tokens", num_accepted_tokens, dims=(1,), dtypes=(torch.int32,))
        if acc_t.shape[0] != len(lens):
            raise NpuOpError(op, "num_accepted_tokens", f"has {acc_t.shape[0]} entries for {len(lens)} requests")
        accepted = [int(a) for a in acc_t.tolist()]
        for b, (a, n) in enumerate(zip(accepted, lens, strict=True)):
            if n and not 1 <= a <= n:
                raise NpuOpError(op, "num_accepted_tokens", f"request {b} accepts {a} tokens; it has {n} "
                                                            f"(1..L_i)")
    # Two requests naming one slot race on it: what it holds afterwards is undefined, emulated as NaN (like the
    # poisoned null block). Not an error: the framework pads decode rows onto the null block, all of them on
    # slot 0, whose contents nobody reads; two real requests sharing a slot get a NaN state and fail loudly.
    owner: dict[int, int] = {}
    raced: set[int] = set()
    for b, (s0, n) in enumerate(zip(starts, lens, strict=True)):
        for s in set(slots[s0:s0 + n]):
            if owner.setdefault(s, b) != b:
                raced.add(s)
    q, k, v, bt, gt, out = _compute_inputs(query, key, value, beta, g, nk, nv)
    cdt = out.dtype
    # Read every request's start before any write (the requests' slots are disjoint, so order does not matter).
    plans = []
    for b, (s0, n) in enumerate(zip(starts, lens, strict=True)):
        if n == 0:
            continue
        first = 0
        if accepted[b] != 1 and slots[s0 + accepted[b] - 1] != slots[s0]:
            # only here do the readings pick different slots
            first = accepted[b] - 1 if consult("gdr_accepted_start") == "accepted_slot" else 0
        plans.append((s0, n, state[slots[s0 + first]].to(cdt).clone()))  # a copy: the slot may be rewritten
    for s0, n, initial in plans:
        own = slots[s0:s0 + n]
        every = any(s != own[-1] for s in own[:-1]) and consult("gdr_state_writes") == "every_token"

        def write(i, s, own=own, every=every, n=n):
            if every or i == n - 1:
                state[own[i]] = s.to(state.dtype)

        rows = slice(s0, s0 + n)
        out[rows], _ = _run(q[rows], k[rows], v[rows], bt[rows], gt[rows] if gt is not None else None, scale,
                            initial, write)
    for s in raced:
        state[s] = float("nan")
    return out.to(query.dtype)


def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                               scale=None, g=None):
    """``(o (T, Nv, Dv), final_state)``: the final state of request b in row b, ``initial_state`` untouched."""
    op = CHUNK
    _required(op, beta=beta, initial_state=initial_state, actual_seq_lengths=actual_seq_lengths, scale=scale)
    tokens, nk, nv, dk, dv = _qkv(op, query, key, value, CHUNK_MAX_HEADS)
    for name, size in (("query", dk), ("value", dv)):
        if size != CHUNK_HEAD_DIM:
            raise NpuOpError(op, name, f"head dim {size} must be {CHUNK_HEAD_DIM} (doc: Dk = Dv = 128)")
    scale = _scale(op, scale)
    lens = _lengths(op, actual_seq_lengths, "query", tokens)
    _state(op, "initial_state", initial_state, nv, dv, dk, query.dtype)
    if initial_state.shape[0] != len(lens):
        raise NpuOpError(op, "initial_state", f"has {initial_state.shape[0]} states for {len(lens)} requests: with "
                                              "no index argument, request b starts from initial_state[b]")
    _per_head(op, "beta", beta, tokens, nv, (query.dtype,))
    g = _gate(op, g, tokens, nv, query.dtype)
    q, k, v, bt, gt, out = _compute_inputs(query, key, value, beta, g, nk, nv)
    final = initial_state.to(out.dtype).clone()
    s0 = 0
    for b, n in enumerate(lens):
        rows = slice(s0, s0 + n)
        out[rows], final[b] = _run(q[rows], k[rows], v[rows], bt[rows], gt[rows] if gt is not None else None, scale,
                                   final[b])
        s0 += n
    return out.to(query.dtype), final.to(initial_state.dtype)


OPS = {RECURRENT: npu_recurrent_gated_delta_rule, CHUNK: npu_chunk_gated_delta_rule}
