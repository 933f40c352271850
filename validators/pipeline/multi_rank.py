"""Attention tensor parallelism: the validation pipeline run on N ranks over torch.distributed.

A way of running the pipeline, not a caller of it: ``run_ranks`` launches N gloo processes, each
running the per-rank step it is handed (``validate.run_pipeline``), and merges their reports.
In each rank the step calls ``shard_attention``: every rank builds the same tiny model (same
seed), keeps its query heads (column split of Q, and of K/V when there are at least as many KV
heads as ranks, else the replicated KV head it maps to; MLA: its query heads, the whole latent),
row-splits O with an all-reduce, and runs the rendered code with its own cache and block tables
over the same request stream. Each rank compares its (all-reduced) logits with the single-rank
transformers reference.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import torch
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.validators.kinds import kind_of
from model_infer_kvcache.validators.kinds.sharding import keep_rows
from model_infer_kvcache.validators.pipeline.report import Check, Report

COLLECTIVE_TIMEOUT_S = 120
RANK_TIMEOUT_S = 900
# Fault injection for the hung-peer test: this rank never joins the group.
HANG_RANK_ENV = "KVCACHE_TP_HANG_RANK"


def _timeouts() -> tuple[float, float]:
    """(collective, whole-rank) timeouts in seconds; the environment may shorten them (tests)."""
    return (float(os.environ.get("KVCACHE_TP_COLLECTIVE_TIMEOUT_S", COLLECTIVE_TIMEOUT_S)),
            float(os.environ.get("KVCACHE_TP_RANK_TIMEOUT_S", RANK_TIMEOUT_S)))


def shard_attention(model, manifest, rank: int, tp: int, group=None) -> None:
    """Keep this rank's heads in every attention module and all-reduce the O projection output."""
    import torch.distributed as dist

    m = manifest.model
    nq = m.num_attention_heads // tp
    heads = slice(rank * nq, (rank + 1) * nq)

    def all_reduce(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    from model_infer_kvcache.analyzer.hf_layout import find_attentions
    from model_infer_kvcache.validators.pipeline.host_model import decoder_layers, find_linear

    loops = manifest.recurrent_loops  # a decoder of several stacks (HRM): each stack's layers
    for layer in decoder_layers(model, loops.stacks if loops else None)[1]:
        linear = find_linear(layer)
        if linear is not None:  # a hybrid's linear layer: its gated delta net holds this rank's key/value heads
            _shard_gated_delta(linear[1], rank, tp).out_proj.register_forward_hook(all_reduce)
            continue
        attn = find_attentions(layer)[0][1]
        v_dim = kind_of(manifest).shard_attention(attn, m, heads, rank, tp)  # this rank's heads (validators/kinds)
        # the output projection: o_proj, or out_proj in the BART-era modules (MusicGen's MusicgenAttention)
        o = attn.o_proj if hasattr(attn, "o_proj") else attn.out_proj
        o.weight = torch.nn.Parameter(o.weight.data[:, heads.start * v_dim:heads.stop * v_dim].clone(),
                                      requires_grad=False)
        if o.bias is not None and rank != 0:
            o.bias = torch.nn.Parameter(torch.zeros_like(o.bias), requires_grad=False)  # added once
        o.register_forward_hook(all_reduce)


def _shard_gated_delta(mod, rank: int, tp: int):
    """Keep this rank's key heads and the value heads they serve in a transformers gated delta net (consecutive
    grouping: value head h uses key head h // (Nv / Nk), so a rank's value heads pair with its own key heads).

    The conv and the fused projections lay channels out [q of every key head | k | v of every value head]
    (Qwen3.5 ``in_proj_qkv``) or grouped per key head (Qwen3-Next ``in_proj_qkvz`` / ``in_proj_ba``); each keeps
    its own order, cut to the rank's heads."""
    from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache
    from model_infer_kvcache.analyzer.linear_config import (
        cca_facts,
        mlstm_facts,
        rg_lru_facts,
        rwkv_facts,
        short_conv_facts,
    )
    from model_infer_kvcache.validators.pipeline.host_model import mamba_scan_of, multihead_mamba

    # the mixers this shard does not cut (a gap of kvcache's, said as such, never the model's failure): what each is,
    # and the layers to validate at attention TP 1
    unsharded = (
        (lambda m: mamba_scan_of(m) is not None or multihead_mamba(m), "a Mamba mixer", "Mamba layers"),
        (mlstm_facts, "an mLSTM layer", "mLSTM layers"),
        (rg_lru_facts, "a RecurrentGemma recurrent block", "RG-LRU blocks"),
        (rwkv_facts, "an RWKV time-mix", "RWKV blocks"),
        (short_conv_facts, "a short conv", "short-conv layers"),
        (cca_facts, "a ZAYA CCA projection", "ZAYA"),
        (lambda m: hasattr(m, "forget_gate"), "Kimi delta attention", "KDA layers"),
    )
    for found, what, layers in unsharded:
        if found(mod):
            raise NotSupportedByKvcache("--attn-tp-size", f"multi-rank validation of {type(mod).__name__} ({what}): "
                                                          f"it shards gated delta nets only; validate {layers} at "
                                                          "attention TP 1", field="attn_tp_size")
    if hasattr(mod, "g_proj"):  # OLMo-Hybrid: projections apart, and its full layers' q/k norm spans every head
        raise NotSupportedByKvcache("--attn-tp-size", f"multi-rank validation of {type(mod).__name__} (OLMo-Hybrid): "
                                                      "it shards the fused Qwen3-Next / Qwen3.5 projections only; "
                                                      "validate OLMo-Hybrid at attention TP 1", field="attn_tp_size")
    nk, nv, dk, dv = mod.num_k_heads, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
    nk_r, nv_r, ratio = nk // tp, nv // tp, nv // nk
    ks, vs = slice(rank * nk_r, (rank + 1) * nk_r), slice(rank * nv_r, (rank + 1) * nv_r)

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:  # dim 0 laid out [q (nk*dk) | k (nk*dk) | v (nv*dv)]
        return torch.cat([t[ks.start * dk:ks.stop * dk], t[nk * dk + ks.start * dk:nk * dk + ks.stop * dk],
                          t[2 * nk * dk + vs.start * dv:2 * nk * dk + vs.stop * dv]])

    def param(t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t.clone(), requires_grad=False)

    if hasattr(mod, "in_proj_qkvz"):
        per = 2 * dk + 2 * dv * ratio
        mod.in_proj_qkvz.weight = keep_rows(mod.in_proj_qkvz.weight, ks.start * per, ks.stop * per)
        mod.in_proj_ba.weight = keep_rows(mod.in_proj_ba.weight, ks.start * 2 * ratio, ks.stop * 2 * ratio)
    else:
        mod.in_proj_qkv.weight = param(qkv_rows(mod.in_proj_qkv.weight.data))
        mod.in_proj_z.weight = keep_rows(mod.in_proj_z.weight, vs.start * dv, vs.stop * dv)
        for proj in (mod.in_proj_b, mod.in_proj_a):
            proj.weight = keep_rows(proj.weight, vs.start, vs.stop)
    mod.conv1d.weight = param(qkv_rows(mod.conv1d.weight.data))
    if mod.conv1d.bias is not None:
        mod.conv1d.bias = param(qkv_rows(mod.conv1d.bias.data))
    mod.A_log, mod.dt_bias = param(mod.A_log.data[vs]), param(mod.dt_bias.data[vs])
    mod.out_proj.weight = param(mod.out_proj.weight.data[:, vs.start * dv:vs.stop * dv])
    mod.num_k_heads, mod.num_v_heads = nk_r, nv_r
    mod.key_dim, mod.value_dim = nk_r * dk, nv_r * dv
    mod.conv_dim = 2 * mod.key_dim + mod.value_dim
    return mod


def _rank_main(step, payload, rank: int, world: int, init_file: str, out_dir: str, environ: dict) -> None:
    """One rank: join the group (bounded timeout), run ``step`` on this rank, write its report. ``environ``: the
    launching process's environment (a forkserver's own is the one it started with)."""
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    result = Path(out_dir) / f"rank{rank}.json"
    if os.environ.get(HANG_RANK_ENV) == str(rank):
        time.sleep(10**6)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=_timeouts()[0]))
        data = step(payload, rank=rank, world=world).to_dict()
    except InputError as exc:  # bad input or something kvcache does not support: the parent raises it again
        data = {"passed": False, "input_error": [exc.where, exc.message, exc.field], "checks": []}
    except Exception as exc:  # reported with the rank id by the parent
        data = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "checks": []}
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    atomic_write_text(result, json.dumps(data))


# What every rank imports before it runs: the forkserver imports it once, each rank forks from it.
_PRELOAD = ["torch", "transformers", "model_infer_kvcache.validators.pipeline.validate",
            "model_infer_kvcache.validators.checkout_run.validate"]


def _rank_context():
    """Ranks fork from a forkserver that imported torch and the validators once (per validating process), not
    from this process (whose thread pools may be busy: forking them is unsafe) nor as fresh interpreters that
    each import everything again (spawn: seconds per rank per run)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(step, payload, tp: int, manifest, progress=None) -> Report:
    """Run ``step(payload, rank=r, world=tp) -> Report`` in ``tp`` gloo processes; merge their reports.

    ``step`` is the pipeline's per-rank run (a module-level function: it crosses the process
    boundary by name) and ``payload`` its picklable inputs; the merged checks carry the rank id.
    """
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcache-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = _rank_context()
        procs = [ctx.Process(target=_rank_main, args=(step, payload, r, tp, init_file, tmp, dict(os.environ)),
                             daemon=True)
                 for r in range(tp)]
        say(f"launching {tp} ranks (gloo)")
        for p in procs:
            p.start()
        rank_timeout = _timeouts()[1]
        deadline = time.monotonic() + rank_timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        merged = Report(backend="emulated", deploy_mode=manifest.deploy_mode.value,
                        model_type=manifest.model.model_type, manifest_hash=manifest.content_hash())
        input_error = None
        for r, p in enumerate(procs):
            if p.is_alive():
                p.terminate()
                p.join(5)
                merged.add(f"rank {r}: finished", "runtime", False,
                           detail=f"no result within {rank_timeout:g}s (hung peer or collective timeout)")
                continue
            path = Path(tmp) / f"rank{r}.json"
            if not path.is_file():
                merged.add(f"rank {r}: finished", "runtime", False, detail=f"exited with code {p.exitcode}")
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("input_error"):
                input_error = input_error or data["input_error"]
                continue
            if data.get("error"):
                merged.add(f"rank {r}: finished", "runtime", False, detail=data["error"])
                continue
            merged.backend = data["backend"]
            merged.dtype, merged.tolerance = data.get("dtype", merged.dtype), data.get("tolerance", merged.tolerance)
            merged.readings = data.get("readings", {})
            merged.consulted = sorted(set(merged.consulted) | set(data.get("consulted", [])))
            for c in data["checks"]:
                merged.checks.append(Check(f"rank {r}: {c['name']}", c["link"], c["passed"], c["measured"],
                                           c["detail"], c["id"]))
            if r == 0:  # every rank runs the same tiny model and stream: one copy of the notes
                merged.notes += data.get("notes", [])
                merged.provenance = data.get("provenance", {})
                merged.localisation = data.get("localisation", {})  # rank 0's (checkout_run/localise.py)
    if input_error:
        where, message, field = input_error
        raise InputError(where, message, field=field)
    merged.notes.insert(0, f"attention TP {tp}: {manifest.parallel.num_q_heads_per_rank} query / "
                           f"{manifest.parallel.num_kv_heads_per_rank} KV heads per rank"
                           + ("; KV heads replicated" if manifest.parallel.kv_heads_replicated else "")
                           + ("; MLA latent replicated" if manifest.parallel.latent_replicated else ""))
    merged.seconds = time.perf_counter() - started
    return merged
