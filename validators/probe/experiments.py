"""The micro-experiments: a few tiny operator calls per question, read back exactly.

Attention experiments use zero queries, so every visible key gets the same weight, and
one-hot values (key ``j`` carries a 1 in lane ``j``): the output row is ``1/|S|`` on the lanes
of the visible key set ``S`` and 0 elsewhere, so ``S`` is read off the output and compared with
each reading's prediction. Writer experiments write distinct rows and read the cache back.
Every experiment records its raw measurements as evidence; an output that matches no reading
is classified ``unknown`` (a finding, not an error). Calls the device rejects are recorded
with the error message; a control call with a supported configuration guards against
blaming the device for a mistake of the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from model_infer_kvcache.analyzer.device_questions import QUESTIONS, UNKNOWN
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS, VALUE_DIM_PAIRS
from model_infer_kvcache.validators.npu_ops.fa_masks import causal_template
from model_infer_kvcache.validators.probe.device import ProbeDevice

HEADS = 8  # FA packed layouts on the device want Q_N = KV_N in 8/16/32/64/128
HEAD_DIM = 128
BLOCK = 16  # paged decode (q_len 1) takes any 16-aligned block size
PRE_TOKENS = 2


@dataclass
class Outcome:
    reading: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- reading the outputs
def visible_keys(row: torch.Tensor) -> list[int] | None:
    """The key set a one-hot/uniform output row shows; ``None`` when the row is not such a mixture."""
    lanes = (row.abs() > 1e-3).nonzero().flatten()
    if lanes.numel() == 0:
        return []
    weights = row[lanes]
    if bool(((weights - 1.0 / lanes.numel()).abs() > 0.03 / lanes.numel() + 2e-3).any()):
        return None
    return [int(x) for x in lanes]


def _call(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - a rejected call is a measurement
        return None, " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _fa(dev: ProbeDevice, version: str, q, k, v, *, q_lens, kv_lens, **kw):
    names = FA_KEYWORDS[version]  # the version's spelling of the renamed arguments
    renamed = {names.q_lens: q_lens, names.kv_lens: kv_lens, names.num_heads: kw.pop("heads"), names.scale: 1.0}
    return getattr(dev.ops, names.op)(q, k, v, **renamed, **kw)[0]


def _onehot(n_keys: int, lanes: int, heads: int = HEADS) -> torch.Tensor:
    """``[n_keys, heads, lanes]`` float32: key j is the basis vector j in every head."""
    return torch.eye(lanes)[:n_keys].unsqueeze(1).expand(n_keys, heads, lanes).contiguous()


def _rows(dev: ProbeDevice, out: torch.Tensor) -> list[list[int] | None]:
    """Visible sets of every query row of a TND output ``[T, N, D]`` (all heads must agree)."""
    o = dev.fetch(out)
    rows = []
    for t in range(o.shape[0]):
        per_head = [visible_keys(o[t, h]) for h in range(o.shape[1])]
        rows.append(per_head[0] if all(p == per_head[0] for p in per_head) else None)
    return rows


def band_sets(q_len: int, kv_len: int, pre: int, reading: str) -> list[list[int]]:
    """Predicted visible keys of each query row under a window reading (mode 4, next_tokens 0)."""
    out = []
    for r in range(q_len):
        pos = r + kv_len - q_len
        lo = pos - pre + (1 if reading == "inclusive" else 0)
        out.append(list(range(max(lo, 0), pos + 1)))
    return out


def _agree(variants: dict[str, dict], readings: list[str | None]) -> tuple[str, str]:
    """One reading when every variant that ran shows the same one; variants the device rejected
    are left out of the verdict (their error is in the evidence)."""
    ran = {name: r for (name, ev), r in zip(variants.items(), readings, strict=True) if "error" not in ev}
    rejected = [name for name in variants if name not in ran]
    note = f"; rejected by the device: {', '.join(rejected)}" if rejected else ""
    if not ran:
        return UNKNOWN, "every variant was rejected" + note
    measured = set(ran.values())
    if len(measured) == 1 and None not in measured:
        return measured.pop(), f"{', '.join(ran)} agree" + note
    if measured == {None}:
        return UNKNOWN, "no variant matched a known reading" + note
    return UNKNOWN, f"variants disagree or some matched nothing: {ran}" + note


# --------------------------------------------------------------------------- window_pre_tokens
WINDOW_Q, WINDOW_KV = 4, 8


def classify_window(rows: list[list[int] | None] | None) -> str | None:
    for reading in QUESTIONS["window_pre_tokens"].readings:
        if rows == band_sets(WINDOW_Q, WINDOW_KV, PRE_TOKENS, reading):
            return reading
    return None


def window_experiment(dev: ProbeDevice) -> Outcome:
    """Prefill rows (q_len 4 > 1, so the band surely applies) of a non-paged TND sparse_mode 4 call."""
    mask = dev.put(causal_template())
    q = dev.put(torch.zeros(WINDOW_Q, HEADS, HEAD_DIM, dtype=dev.dtype))
    kv = dev.put(_onehot(WINDOW_KV, HEAD_DIM).to(dev.dtype))
    variants: dict[str, dict] = {}
    readings = []
    for version in ("v1", "v2"):
        out, err = _call(lambda version=version: _fa(
            dev, version, q, kv, kv, q_lens=[WINDOW_Q], kv_lens=[WINDOW_KV], heads=HEADS, num_key_value_heads=HEADS,
            input_layout="TND", sparse_mode=4, pre_tokens=PRE_TOKENS, next_tokens=0, atten_mask=mask))
        rows = None if err else _rows(dev, out)
        variants[f"{version} TND"] = {"error": err} if err else {"visible_per_row": rows}
        readings.append(classify_window(rows))
    reading, why = _agree(variants, readings)
    preds = {r: band_sets(WINDOW_Q, WINDOW_KV, PRE_TOKENS, r) for r in QUESTIONS["window_pre_tokens"].readings}
    return Outcome(reading, f"q_len {WINDOW_Q}, kv_len {WINDOW_KV}, pre_tokens {PRE_TOKENS}: {why}",
                   {"variants": variants, "predicted": preds})


# --------------------------------------------------------------------------- band_at_single_query
BAND_KV = 24
BAND_TABLE = [3, 1]  # physical blocks of the request; block 0 is the null block


def classify_band(visible: list[int] | None, window_reading: str) -> str | None:
    if visible == list(range(BAND_KV)):
        return "ignored"
    honoured = ([band_sets(1, BAND_KV, PRE_TOKENS, window_reading)[0]] if window_reading != UNKNOWN
                else [band_sets(1, BAND_KV, PRE_TOKENS, r)[0] for r in QUESTIONS["window_pre_tokens"].readings])
    return "honoured" if visible in honoured else None


def band_experiment(dev: ProbeDevice, window_reading: str) -> Outcome:
    """Paged TND decode (q_len 1) with sparse_mode 4 + pre_tokens, as the sliding-window designs call it."""
    blocks = torch.zeros(4 * BLOCK, HEADS, HEAD_DIM)
    for pos in range(BAND_KV):
        blocks[BAND_TABLE[pos // BLOCK] * BLOCK + pos % BLOCK] = _onehot(BAND_KV, HEAD_DIM)[pos]
    cache = dev.put(blocks.view(4, BLOCK, HEADS * HEAD_DIM).to(dev.dtype))
    table = dev.put(torch.tensor([BAND_TABLE], dtype=torch.int32))
    mask = dev.put(causal_template())
    q = dev.put(torch.zeros(1, HEADS, HEAD_DIM, dtype=dev.dtype))
    variants: dict[str, dict] = {}
    readings = []
    for version in ("v1", "v2"):
        out, err = _call(lambda version=version: _fa(
            dev, version, q, cache, cache, q_lens=[1], kv_lens=[BAND_KV], heads=HEADS, num_key_value_heads=HEADS,
            input_layout="TND", sparse_mode=4, pre_tokens=PRE_TOKENS, next_tokens=0, atten_mask=mask,
            block_table=table, block_size=BLOCK))
        visible = None if err else _rows(dev, out)[0]
        variants[f"{version} TND paged"] = {"error": err} if err else {"visible": visible}
        readings.append(classify_band(visible, window_reading))
    reading, why = _agree(variants, readings)
    return Outcome(reading, f"q_len 1, kv_len {BAND_KV}, pre_tokens {PRE_TOKENS} (window reading "
                            f"{window_reading}): {why}", {"variants": variants})


# --------------------------------------------------------------------------- null_block_contents
NULL_SENTINEL = 3.0


def classify_null(block: torch.Tensor) -> tuple[str, dict]:
    counts = {"zero": int((block == 0).sum()), "sentinel": int((block == NULL_SENTINEL).sum()),
              "nan": int(torch.isnan(block).sum()), "total": block.numel()}
    counts["other"] = counts["total"] - counts["zero"] - counts["sentinel"] - counts["nan"]
    for reading, key in (("zeros", "zero"), ("stale", "sentinel"), ("poisoned", "nan")):
        if counts[key] == counts["total"]:
            return reading, counts
    return UNKNOWN, counts


def null_block_experiment(dev: ProbeDevice) -> Outcome:
    """Allocate a cache like the framework (torch.empty), write block 1 only, read the never-written block 0."""
    bn, n, d = 2, 1, 16
    cache = dev.never_written((bn, BLOCK, n, d), dev.dtype, NULL_SENTINEL)
    rows = dev.put(torch.ones(4, n, d, dtype=dev.dtype))
    slots = dev.put(torch.arange(BLOCK, BLOCK + 4, dtype=torch.int64).view(-1, 1))
    _, err = _call(lambda: dev.ops.npu_scatter_nd_update_(cache.view(bn * BLOCK, n, d), slots, rows))
    if err:
        return Outcome(UNKNOWN, f"the control write to block 1 failed: {err}", {"error": err})
    reading, counts = classify_null(dev.fetch(cache[0]))
    return Outcome(reading, f"never-written block 0 after a write to block 1: {counts}", {"block0": counts})


# --------------------------------------------------------------------------- repeated_slots
PAD_ROWS = 3  # padded decode rows, all writing slot 0


def classify_slots(slot0: torch.Tensor, rows: torch.Tensor, others_ok: bool) -> str | None:
    """Which written row the repeated slot holds; ``None`` when it is none of the readings."""
    if not others_ok:
        return None
    if torch.equal(slot0, rows[PAD_ROWS - 1]):
        return "last_wins"
    if torch.equal(slot0, rows[0]):
        return "first_wins"
    return None


def _scatter_variant(dev: ProbeDevice, slots: list[int]) -> tuple[dict, str | None]:
    n, d, fill = 1, 16, -7.0
    cache = dev.put(torch.full((2 * BLOCK, n, d), fill, dtype=dev.dtype))
    rows = torch.arange(1, len(slots) + 1, dtype=torch.float32).view(-1, 1, 1).expand(-1, n, d).to(dev.dtype)
    index = dev.put(torch.tensor(slots, dtype=torch.int64).view(-1, 1))
    _, err = _call(lambda: dev.ops.npu_scatter_nd_update_(cache, index, dev.put(rows.contiguous())))
    if err:
        return {"error": err}, None
    got = dev.fetch(cache)
    want = torch.full_like(got, fill)
    want[slots[-1]] = rows[-1].float()
    others = [s for s in range(got.shape[0]) if s != 0]
    others_ok = torch.equal(got[others], want[others])
    reading = classify_slots(got[0], rows.float(), others_ok)
    return {"slot0_row_value": float(got[0].flatten()[0]), "others_untouched": others_ok}, reading


def _mla_writer_variant(dev: ProbeDevice, slots: list[int]) -> tuple[dict, str | None]:
    dv, dk, bs, fill = 512, 64, 128, -7.0
    tokens = len(slots)
    gen = torch.Generator().manual_seed(0)
    kv = dev.put(torch.randn(tokens, 1, 1, dv + dk, generator=gen).to(dev.dtype))
    gamma = dev.put(torch.ones(dv, dtype=dev.dtype))
    cos = dev.put(torch.ones(tokens, 1, 1, dk, dtype=dev.dtype))
    sin = dev.put(torch.zeros(tokens, 1, 1, dk, dtype=dev.dtype))
    k_cache = dev.put(torch.full((2, bs, 1, dk), fill, dtype=dev.dtype))
    ckv_cache = dev.put(torch.full((2, bs, 1, dv), fill, dtype=dev.dtype))
    index = dev.put(torch.tensor(slots, dtype=torch.int64))
    # No model here: the epsilon only has to be the same for every row (the rows are compared with
    # the op's own outputs).
    result, err = _call(lambda: dev.ops.npu_kv_rmsnorm_rope_cache_v2(  # kvcache: ignore[KV601]
        kv, gamma, cos, sin, index, k_cache, ckv_cache, epsilon=1e-6, cache_mode="PA", is_output_kv=True))
    if err:
        return {"error": err}, None
    c_kv = dev.fetch(result[1]).view(tokens, dv)
    got = dev.fetch(ckv_cache).view(2 * bs, dv)
    last = slots[-1]
    others = [s for s in range(2 * bs) if s not in (0, last)]
    others_ok = bool((got[others] == fill).all()) and torch.equal(got[last], c_kv[-1])
    reading = classify_slots(got[0], c_kv, others_ok)
    match = [i for i in range(tokens) if torch.equal(got[0], c_kv[i])]
    return {"slot0_equals_rows": match, "others_untouched": others_ok}, reading


def repeated_slots_experiment(dev: ProbeDevice) -> Outcome:
    """Three padded rows write slot 0, one real row writes a slot of block 1 (a padded decode batch)."""
    variants: dict[str, dict] = {}
    readings = []
    for name, run, real_slot in (("npu_scatter_nd_update_", _scatter_variant, BLOCK + 1),
                                 ("npu_kv_rmsnorm_rope_cache_v2 PA", _mla_writer_variant, 129)):
        control, control_reading = run(dev, list(range(1, PAD_ROWS + 1)) + [real_slot])
        if "error" in control:  # unique slots failed: the probe's call is wrong, not the device
            variants[name] = {"error": f"control call failed: {control['error']}"}
            readings.append(None)
            continue
        evidence, reading = run(dev, [0] * PAD_ROWS + [real_slot])
        if "error" in evidence:  # the control passed: refusing the repeats is the reading
            evidence, reading = {"rejected_repeats": evidence["error"]}, "error"
        variants[name] = evidence
        readings.append(reading)
    reading, why = _agree(variants, readings)
    return Outcome(reading, f"{PAD_ROWS} rows to slot 0 + one real row: {why}", {"variants": variants})


# --------------------------------------------------------------------------- mla_decode_sparse_mode3
MLA_KV, MLA_BS, MLA_DV, MLA_DR = 8, 16, 512, 64  # block 16: allowed for an ND MLA cache


def classify_mla(mode0_visible, mode3_visible, max_diff: float | None, scale: float, mode3_error: str | None) -> str:
    if mode3_error is not None:
        return "rejected"
    if mode3_visible == mode0_visible and max_diff is not None and max_diff <= 0.02 * max(scale, 1e-6):
        return "same_as_mode0"
    return "deviates"


def mla_experiment(dev: ProbeDevice) -> Outcome:
    """FA v2 MLA absorb decode (TND_NTD, paged latent + rope caches, q_len 1): sparse_mode 3 + mask vs 0."""
    gen = torch.Generator().manual_seed(1)
    mask = dev.put(causal_template())
    table = dev.put(torch.tensor([[1]], dtype=torch.int32))

    def call(mode: int, q, q_rope, latent, rope):
        extra = {"atten_mask": mask} if mode == 3 else {}
        return dev.ops.npu_fused_infer_attention_score_v2(
            q, latent, latent, query_rope=q_rope, key_rope=rope, actual_seq_qlen=[1], actual_seq_kvlen=[MLA_KV],
            block_table=table, num_query_heads=HEADS, num_key_value_heads=1, softmax_scale=1.0,
            input_layout="TND_NTD", block_size=MLA_BS, sparse_mode=mode, **extra)[0]

    def caches(one_hot: bool):
        latent = torch.zeros(2, MLA_BS, MLA_DV)
        rope = torch.zeros(2, MLA_BS, MLA_DR)
        if one_hot:
            latent[1, :MLA_KV] = torch.eye(MLA_DV)[:MLA_KV]
        else:
            latent[1, :MLA_KV] = torch.randn(MLA_KV, MLA_DV, generator=gen)
            rope[1, :MLA_KV] = torch.randn(MLA_KV, MLA_DR, generator=gen)
        return dev.put(latent.to(dev.dtype)), dev.put(rope.to(dev.dtype))

    zeros_q = (dev.put(torch.zeros(1, HEADS, MLA_DV, dtype=dev.dtype)),
               dev.put(torch.zeros(1, HEADS, MLA_DR, dtype=dev.dtype)))
    rand_q = (dev.put(torch.randn(1, HEADS, MLA_DV, generator=gen).mul(0.05).to(dev.dtype)),
              dev.put(torch.randn(1, HEADS, MLA_DR, generator=gen).mul(0.05).to(dev.dtype)))
    onehot, random = caches(True), caches(False)
    evidence: dict[str, Any] = {}
    vis: dict[int, Any] = {}
    rnd: dict[int, Any] = {}
    errors: dict[int, str | None] = {}
    for mode in (0, 3):
        out, errors[mode] = _call(lambda mode=mode: call(mode, *zeros_q, *onehot))
        if errors[mode] is None:
            vis[mode] = visible_keys(dev.fetch(out)[0, 0])  # NTD output: head 0, token 0
            out2, errors[mode] = _call(lambda mode=mode: call(mode, *rand_q, *random))
            rnd[mode] = None if errors[mode] else dev.fetch(out2)
        evidence[f"sparse_mode {mode}"] = {"error": errors[mode]} if errors[mode] else {"visible": vis[mode]}
    if errors[0] is not None:
        return Outcome(UNKNOWN, f"the mode-0 control call failed: {errors[0]}", evidence)
    diff = scale = None
    if errors[3] is None:
        diff = float((rnd[3] - rnd[0]).abs().max())
        scale = float(rnd[0].abs().max())
        evidence["random_inputs"] = {"max_abs_diff": diff, "max_abs_mode0": scale}
    reading = classify_mla(vis[0], vis.get(3), diff, scale or 0.0, errors[3])
    return Outcome(reading, f"q_len 1, kv_len {MLA_KV}, {HEADS} heads: mode 3 {reading.replace('_', ' ')}"
                            + (f" (max |diff| {diff:.3g})" if diff is not None else ""), evidence)


# --------------------------------------------------------------------------- finalize_skip1_alone
FIN_ROWS, FIN_K, FIN_H = 4, 2, 16


def classify_finalize(alone, base, skip1, error: str | None) -> str:
    """``alone``: the output with skip1 only; ``base``: with neither skip (both measured on the device)."""
    if error is not None:
        return "rejected"
    if torch.equal(alone, base + skip1):
        return "added"
    if torch.equal(alone, base):
        return "ignored"
    return UNKNOWN


def finalize_experiment(dev: ProbeDevice) -> Outcome:
    """``npu_moe_finalize_routing`` with skip1 and no skip2, next to the documented forms (both skips,
    neither). Small integers: every sum is exact in bfloat16, so the readings are told apart by equality."""
    rows = torch.arange(FIN_ROWS * FIN_K * FIN_H).remainder(7).view(FIN_ROWS * FIN_K, FIN_H).float()
    skip1 = torch.full((FIN_ROWS, FIN_H), 16.0)
    skip2 = torch.full((FIN_ROWS, FIN_H), 32.0)
    scales = torch.tensor([[1.0, 2.0]]).expand(FIN_ROWS, FIN_K).contiguous()
    src = torch.arange(FIN_ROWS * FIN_K, dtype=torch.int32)

    def call(s1, s2):
        args = [dev.put(t.to(dev.dtype)) if t is not None else None for t in (rows, s1, s2)]
        return dev.ops.npu_moe_finalize_routing(args[0], args[1], args[2], None, dev.put(scales.to(dev.dtype)),
                                                dev.put(src), None, drop_pad_mode=0)

    base, err = _call(lambda: call(None, None))
    both, err2 = _call(lambda: call(skip1, skip2))
    if err or err2:
        return Outcome(UNKNOWN, f"a documented control call failed: {err or err2}", {"error": err or err2})
    base = dev.fetch(base)
    if not torch.equal(dev.fetch(both), base + skip1 + skip2):
        return Outcome(UNKNOWN, "the documented call with both skips does not add them: the probe's call is wrong",
                       {"both_minus_base": float((dev.fetch(both) - base).mean())})
    alone, error = _call(lambda: call(skip1, None))
    if error is None:
        alone = dev.fetch(alone)
        evidence = {"alone_minus_base": sorted({float(x) for x in (alone - base).flatten()})[:4]}
    else:
        evidence = {"error": error}
    reading = classify_finalize(alone, base, skip1, error)
    return Outcome(reading, f"skip1 (16) without skip2: {reading}", evidence)


# --------------------------------------------------------------------------- gated delta rule (gdr_*)
GDR_D = 16  # Dk = Dv, inside the documented <= 256
GDR_DTYPE = torch.bfloat16  # the op's only documented dtype (small integers: exact)


def _gdr(dev: ProbeDevice, *, q, k, v, beta, state, lens, slots, accepted=None):
    """npu_recurrent_gated_delta_rule, scale 1, no decay; ``state`` is a device tensor updated in place."""
    put = [dev.put(t.to(GDR_DTYPE)) for t in (q, k, v, beta)]
    ints = {"actual_seq_lengths": dev.put(torch.tensor(lens, dtype=torch.int32)),
            "ssm_state_indices": dev.put(torch.tensor(slots, dtype=torch.int32))}
    if accepted is not None:
        ints["num_accepted_tokens"] = dev.put(torch.tensor(accepted, dtype=torch.int32))
    return dev.ops.npu_recurrent_gated_delta_rule(put[0], put[1], put[2], state, beta=put[3], scale=1.0, **ints)


def _lane(i: int, value: float = 1.0) -> torch.Tensor:
    out = torch.zeros(GDR_D)
    out[i] = value
    return out


def classify_gdr_writes(slot1: torch.Tensor, slot2: torch.Tensor, after_first: torch.Tensor,
                        final: torch.Tensor) -> str | None:
    """Slot 1 (token 0's) holds the state after token 0, or was left alone (zeros); slot 2 must hold the final
    state under either reading."""
    if not torch.equal(slot2, final):
        return None
    for reading in QUESTIONS["gdr_state_writes"].readings:
        if torch.equal(slot1, after_first if reading == "every_token" else torch.zeros_like(slot1)):
            return reading
    return None


def gdr_writes_experiment(dev: ProbeDevice) -> Outcome:
    """One request of 2 tokens on slots [1, 2], beta 1, q = k = lane 0: the state after token i is v_i e0^T."""
    v = torch.stack([_lane(0, 1.0), _lane(1, 2.0)]).view(2, 1, GDR_D)
    k = torch.stack([_lane(0)] * 2).view(2, 1, GDR_D)
    state = dev.put(torch.zeros(3, 1, GDR_D, GDR_D, dtype=GDR_DTYPE))
    _, error = _call(lambda: _gdr(dev, q=k, k=k, v=v, beta=torch.ones(2, 1), state=state, lens=[2], slots=[1, 2]))
    if error is not None:
        return Outcome(UNKNOWN, f"the call failed: {error}", {"error": error})
    got = dev.fetch(state)
    after_first = torch.zeros(1, GDR_D, GDR_D)
    after_first[0, 0, 0] = 1.0
    final = torch.zeros(1, GDR_D, GDR_D)
    final[0, 1, 0] = 2.0
    reading = classify_gdr_writes(got[1], got[2], after_first, final) or UNKNOWN
    evidence = {"slot1_nonzero": got[1].nonzero().tolist()[:4], "slot2_nonzero": got[2].nonzero().tolist()[:4]}
    return Outcome(reading, f"2 tokens on slots [1, 2]: slot 1 {'written' if got[1].any() else 'untouched'}",
                   evidence)


def classify_gdr_start(out_accepted: float, out_control: float) -> str | None:
    """Token 0's output (beta 0: the initial state read by q = e0) is 3 from slot 2, 0 from slot 1."""
    if out_control != 0.0:
        return None
    for reading in QUESTIONS["gdr_accepted_start"].readings:
        if out_accepted == (3.0 if reading == "accepted_slot" else 0.0):
            return reading
    return None


def gdr_start_experiment(dev: ProbeDevice) -> Outcome:
    """2 tokens on slots [1, 2] with num_accepted_tokens [2]: slot 1 holds 0, slot 2 holds 3 e0 e0^T."""
    q = torch.stack([_lane(0)] * 2).view(2, 1, GDR_D)
    v = torch.zeros(2, 1, GDR_D)

    def run(accepted):
        state = torch.zeros(3, 1, GDR_D, GDR_D)
        state[2, 0, 0, 0] = 3.0
        out = _gdr(dev, q=q, k=q, v=v, beta=torch.zeros(2, 1), state=dev.put(state.to(GDR_DTYPE)), lens=[2],
                   slots=[1, 2], accepted=accepted)
        return float(dev.fetch(out)[0, 0, 0])

    control, error = _call(lambda: run(None))
    if error is not None:
        return Outcome(UNKNOWN, f"the control call (no num_accepted_tokens) failed: {error}", {"error": error})
    got, error = _call(lambda: run([2]))
    if error is not None:
        return Outcome(UNKNOWN, f"num_accepted_tokens [2] was rejected: {error}", {"error": error})
    reading = classify_gdr_start(got, control) or UNKNOWN
    return Outcome(reading, f"num_accepted_tokens [2]: token 0 reads {got:g} (slot 1 holds 0, slot 2 holds 3)",
                   {"token0_lane0": got, "control_token0_lane0": control})


def classify_gdr_grouping(per_value_head: list[float], factors: list[float]) -> str | None:
    nk, nv = len(factors), len(per_value_head)
    for reading in QUESTIONS["gdr_head_grouping"].readings:
        heads = [h % nk if reading == "strided" else h // (nv // nk) for h in range(nv)]
        if per_value_head == [factors[h] for h in heads]:
            return reading
    return None


def gdr_grouping_experiment(dev: ProbeDevice) -> Outcome:
    """Nk 2, Nv 4, one token, beta 1: value head h outputs q.k of the key head serving it (1 or 2) in lane 0."""
    factors = [1.0, 2.0]
    q = torch.stack([_lane(0, f) for f in factors]).view(1, 2, GDR_D)
    k = torch.stack([_lane(0)] * 2).view(1, 2, GDR_D)
    v = torch.stack([_lane(0)] * 4).view(1, 4, GDR_D)
    state = dev.put(torch.zeros(1, 4, GDR_D, GDR_D, dtype=GDR_DTYPE))
    out, error = _call(lambda: _gdr(dev, q=q, k=k, v=v, beta=torch.ones(1, 4), state=state, lens=[1], slots=[0]))
    if error is not None:
        return Outcome(UNKNOWN, f"the call failed: {error}", {"error": error})
    per_head = [float(x) for x in dev.fetch(out)[0, :, 0]]
    reading = classify_gdr_grouping(per_head, factors) or UNKNOWN
    return Outcome(reading, f"Nk 2 (q.k 1, 2), Nv 4: value heads read {per_head}", {"per_value_head": per_head})


# --------------------------------------------------------------------------- value_head_dim
VALUE_KV = 3  # keys of the value-dim call: equal scores (zero keys), so its output is the mean of their values


def value_dim_experiment(dev: ProbeDevice) -> Outcome:
    """Paged TND decode through FA v2 with K_D 192 and V_D 128 (the pair the TND section lists, MiMo-V2-Flash's):
    zero keys give equal scores, one-hot values make the output the uniform mixture of the visible keys."""
    (k_dim, v_dim), = sorted(VALUE_DIM_PAIRS)
    keys = dev.put(torch.zeros(1, BLOCK, HEADS * k_dim, dtype=dev.dtype))
    values = torch.zeros(BLOCK, HEADS, v_dim)
    values[:VALUE_KV] = _onehot(VALUE_KV, v_dim)
    values = dev.put(values.view(1, BLOCK, HEADS * v_dim).to(dev.dtype))
    q = dev.put(torch.zeros(1, HEADS, k_dim, dtype=dev.dtype))
    out, error = _call(lambda: _fa(dev, "v2", q, keys, values, q_lens=[1], kv_lens=[VALUE_KV], heads=HEADS,
                                   num_key_value_heads=HEADS, input_layout="TND", sparse_mode=0,
                                   block_table=dev.put(torch.zeros(1, 1, dtype=torch.int32)), block_size=BLOCK))
    if error is not None:
        return Outcome("equal_only", f"K_D {k_dim} / V_D {v_dim} refused: {error}", {"error": error})
    visible = _rows(dev, out)[0]
    reading = "documented_pairs" if visible == list(range(VALUE_KV)) else UNKNOWN
    return Outcome(reading, f"K_D {k_dim} / V_D {v_dim}, kv_len {VALUE_KV}: output mixes keys {visible}",
                   {"visible": visible})


def run_experiments(dev: ProbeDevice) -> dict[str, Outcome]:
    """Every question's outcome, in ``QUESTIONS`` order (the band reads its prediction off the window)."""
    window = window_experiment(dev)
    done = {
        "window_pre_tokens": window,
        "band_at_single_query": band_experiment(dev, window.reading),
        "null_block_contents": null_block_experiment(dev),
        "repeated_slots": repeated_slots_experiment(dev),
        "finalize_skip1_alone": finalize_experiment(dev),
        "mla_decode_sparse_mode3": mla_experiment(dev),
        "gdr_state_writes": gdr_writes_experiment(dev),
        "gdr_accepted_start": gdr_start_experiment(dev),
        "gdr_head_grouping": gdr_grouping_experiment(dev),
        "value_head_dim": value_dim_experiment(dev),
    }
    return {q: done[q] for q in QUESTIONS}
