"""Each golden paged attention module (and the Legacy standalone one), run on CPU with the emulated
torch_npu operators, against a dense float64 attention written here.

Framework mode goes through the framework harness (get_cache_info -> Scheduler -> block tables,
slot mappings, freed and null blocks poisoned with NaN before every step); standalone mode
through the rendered runner (static arange table, runner-owned kv_len, unwritten cache NaN).
A small batch of prompts of different lengths (one past a 128-token block, two past the
shrunken sliding window, one whose leading sliding block is the null block) is prefilled, then
decoded for a few steps, with random q/k/v (or MLA latent) inputs per token. The real head
counts are used (they are constants in the rendered code); only the layers are few.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _golden_module():
    """tests/golden/regenerate.py (the case table), loaded once by path: tests/ is not a package."""
    if "golden_regenerate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("golden_regenerate", ROOT / "tests" / "golden" / "regenerate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["golden_regenerate"] = module
        spec.loader.exec_module(module)
    return sys.modules["golden_regenerate"]


golden = _golden_module()

TOL = 1e-4
WINDOW = 48  # SLIDING_WINDOW rebound before init_kv_cache, as the validators do, so prompts cross it
# 174: its first block slides out of the window during decode (freed, then poisoned); 200 > block + window:
# its first sliding block is already the null block at prefill.
SLIDING_PROMPTS = (5, 174, 200)
FULL_PROMPTS = (7, 60, 140)  # no window to cross: one prompt past a 128-token block is enough
MLA_PROMPTS = (9, 135)  # MLA with up to 128 query heads: the expanded float64 reference is the costly part
DECODE_STEPS = 3
MAX_LEN = 256
ROPE_BASE = 10000.0
NORM_EPS = 0.05  # far from any literal default: a hard-coded epsilon shows up as a mismatch

PAGED_MODELS = ("qwen3_v1", "qwen3_v2", "gpt_oss", "mistral", "deepseek_v3", "deepseek_v2_lite")


def _case(model: str, mode: str):
    return next(c for c in golden.CASES if c.model.name == model and c.mode == mode)


def _params():
    return [pytest.param(model, mode, id=f"{model}-{mode}") for model in PAGED_MODELS for mode in golden.MODES]


# ----------------------------------------------------------------------------- reference (float64)


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The MLA writer's RoPE: de-interleave even/odd lanes, then rotate half (float64 here)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1, x2), -1) * cos + torch.cat((-x2, x1), -1) * sin


def _rotate_half_cos_sin(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


@dataclass
class Layer:
    """One attention layer under test and its float64 history per request."""

    attn: object
    sliding: bool
    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class Model:
    """Random inputs per token and the dense reference, for one manifest."""

    def __init__(self, manifest, seed: int = 0):
        self.m = manifest
        self.mla = manifest.mla.enabled
        self.scale = manifest.fa.softmax_scale
        self.heads = manifest.parallel.num_q_heads_per_rank
        self.kv_heads = manifest.parallel.num_kv_heads_per_rank
        self.dim = manifest.model.head_dim
        self.gen = torch.Generator().manual_seed(seed)
        if self.mla:
            d = manifest.model.mla
            self.lora, self.rope, self.nope, self.vdim = d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim
        self.sinks = self._rand(self.heads) if manifest.model.has_sinks else None
        legacy = manifest.legacy_attention
        # The model's own soft-cap (Gemma-2): the Legacy render keeps it, so the reference applies it too.
        self.softcap = legacy.softcap if legacy is not None else None

    def _rand(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32) * scale

    def equip(self, attn) -> None:
        """The attributes the rendered mixin reads from the model's attention module."""
        if self.sinks is not None:
            attn.sinks = self.sinks.clone()
        if self.mla:
            attn.kv_a_layernorm = types.SimpleNamespace(weight=1.0 + self._rand(self.lora, scale=0.1),
                                                        variance_epsilon=NORM_EPS)
            attn.kv_b_proj = types.SimpleNamespace(
                weight=self._rand(self.heads * (self.nope + self.vdim), self.lora, scale=0.05))

    # ---- one step of one layer: run the rendered code and the reference
    def step(self, layer: Layer, rids: list[int], positions: torch.Tensor, q_lens: list[int], fm,
             bsh: bool = False) -> float:
        """``bsh``: Legacy call, every request has the same q_len and tensors are [B, S, heads * D]."""
        t = positions.numel()
        if self.mla:
            q_nope = self._rand(t, self.heads, self.nope, scale=0.5)
            q_pe = self._rand(t, self.heads, self.rope, scale=0.5)  # stands for an already-rotated q_pe
            ckv = self._rand(t, self.lora + self.rope)
            cos, sin = _rotate_half_cos_sin(positions, self.rope)
            got = layer.attn.kv_cache_attention(q_nope, q_pe, ckv, cos.float(), sin.float(), fm)
            q, k, v = self._expanded_mla(layer.attn, q_nope, q_pe, ckv, cos, sin)
        else:
            # Scores of the soft-cap's size (std ~ cap), so that dropping the cap shows; else O(1) scores.
            q_scale = 0.5 if self.softcap is None else 2 * self.softcap / (self.scale * self.dim ** 0.5)
            q = self._rand(t, self.heads, self.dim, scale=q_scale)
            k = self._rand(t, self.kv_heads, self.dim, scale=0.5)
            v = self._rand(t, self.kv_heads, self.dim)
            if bsh:
                batch = len(rids)
                got = layer.attn.kv_cache_attention(*(x.reshape(batch, t // batch, -1) for x in (q, k, v)), fm)
            else:
                got = layer.attn.kv_cache_attention(q, k, v, fm)
        want = self._reference(layer, rids, positions, q_lens, q.double(), k.double(), v.double())
        got = got.reshape(want.shape).double()
        assert torch.isfinite(got).all(), "rendered attention produced non-finite values"
        return float((got - want).abs().max())

    def _expanded_mla(self, attn, q_nope, q_pe, ckv, cos, sin):
        """MLA without absorb, in float64: per head k = [W_UK norm(latent); rope(k_pe)], v = W_UV norm(latent)."""
        norm = attn.kv_a_layernorm
        latent = ckv[:, : self.lora].double()
        latent = latent / torch.sqrt(latent.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        latent = latent * norm.weight.double()
        k_pe = _interleaved_rope(ckv[:, self.lora:].double(), cos, sin)
        w = attn.kv_b_proj.weight.double().view(self.heads, self.nope + self.vdim, self.lora)
        k_nope = torch.einsum("npl,tl->tnp", w[:, : self.nope], latent)
        v = torch.einsum("nvl,tl->tnv", w[:, self.nope:], latent)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.heads, -1)), -1)
        q = torch.cat((q_nope.double(), q_pe.double()), -1)
        return q, k, v

    def _walk(self, layer: Layer, rids, positions, q_lens, new_k, new_v):
        """Append this step's keys/values to the history; yield (rows, rid, positions, keys, values) per request."""
        start = 0
        for rid, n in zip(rids, q_lens, strict=True):
            pos = positions[start:start + n].long()
            if int(pos[0]) == 0:
                layer.keys[rid], layer.values[rid] = [], []
            cached = sum(chunk.shape[0] for chunk in layer.keys[rid])
            assert pos.tolist() == list(range(cached, cached + n)), f"request {rid}: positions not contiguous"
            layer.keys[rid].append(new_k[start:start + n])
            layer.values[rid].append(new_v[start:start + n])
            yield slice(start, start + n), pos, torch.cat(layer.keys[rid]), torch.cat(layer.values[rid])
            start += n

    def _visible(self, layer: Layer, pos: torch.Tensor, total: int) -> torch.Tensor:
        """[queries, keys] bool: causal, and for sliding layers the W keys up to and including the query."""
        j = torch.arange(total)[None, :]
        i = pos[:, None]
        lo = i - WINDOW + 1 if layer.sliding else torch.zeros_like(i)
        return (j <= i) & (j >= lo)

    def _attend(self, scores: torch.Tensor, vis: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """scores [Q, N, K], vis [Q, K], values [N, K, Dv] -> [Q, N, Dv] (softmax with the sink, if any)."""
        scores = scores.masked_fill(~vis[:, None, :], -math.inf)
        top = scores.max(-1, keepdim=True).values
        sink = self.sinks.double()[None, :, None] if self.sinks is not None else None
        if sink is not None:
            top = torch.maximum(top, sink)
        weights = torch.exp(scores - top)
        denom = weights.sum(-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - top)
        return torch.einsum("qnk,nkd->qnd", weights / denom, values)

    def _reference(self, layer, rids, positions, q_lens, q, k, v) -> torch.Tensor:
        """Dense attention of every query over its request's keys so far: q [T, N, Dk], k [T, Nk, Dk], v [T, Nk, Dv]."""
        group = q.shape[1] // k.shape[1]
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
        for rows, pos, keys, vals in self._walk(layer, rids, positions, q_lens, k, v):
            if group > 1:  # query head h reads KV head h // group
                keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            vals = vals.transpose(0, 1)  # [N, K, Dv]
            scores = torch.einsum("qnd,knd->qnk", q[rows], keys) * self.scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            out[rows] = self._attend(scores, self._visible(layer, pos, keys.shape[0]), vals)
        return out


# ----------------------------------------------------------------------------- drivers


def _layers(code, model: Model, manifest) -> list[Layer]:
    mod = code.attention
    if hasattr(mod, "SLIDING_WINDOW"):
        mod.SLIDING_WINDOW = WINDOW
    attn_cls = type("AttentionUnderTest", (code.attention_mixin(),), {})
    # The first layer of each kind: mixed models get one sliding and one full layer.
    picks = sorted({next(p.index for p in manifest.layers if p.attn_type == kind)
                    for kind in {p.attn_type for p in manifest.layers}})
    layers = []
    for idx in picks:
        attn = attn_cls()
        model.equip(attn)
        attn.init_kv_cache(idx, torch.float32)
        want = manifest.layers[idx]
        assert attn.attn_type == want.attn_type == want.group_key, (idx, attn.attn_type, want.attn_type)
        if want.attn_type == "SlidingWindow" and hasattr(mod, "WINDOW_PRE_TOKENS_OFFSET"):
            # The band admits W keys including the query under the manifest's reading (exclusive); a render
            # with the model's own attention masks the window itself (no band).
            assert attn.window_pre_tokens == WINDOW - (want.sliding_window - want.pre_tokens)
        layers.append(Layer(attn, want.attn_type == "SlidingWindow"))
    return layers


def default_prompts(manifest) -> tuple[int, ...]:
    if any(p.attn_type == "SlidingWindow" for p in manifest.layers):
        return SLIDING_PROMPTS
    return MLA_PROMPTS if manifest.mla.enabled else FULL_PROMPTS


def run_framework(case, prompts=None, check=None) -> list[tuple[str, float]]:
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.validators.harness import FrameworkAPI, Scheduler, install_framework
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    manifest = load_manifest(case.dir / golden.MANIFEST_FILE)
    prompts = prompts or default_prompts(manifest)
    generation = manifest.framework_api
    errors = []
    with install_emulation(), install_framework(generation) as handle:
        code = import_rendered(case.dir)
        model = Model(manifest)
        layers = _layers(code, model, manifest)
        host = types.SimpleNamespace(block_size=manifest.block_size, model=types.SimpleNamespace(
            layers=[types.SimpleNamespace(self_attn=layer.attn) for layer in layers]))
        info = code.model_mixin().get_cache_info(host)
        assert len(info.layer_infos) == len(layers)
        sched = Scheduler(info, max_model_len=MAX_LEN, max_concurrency=len(prompts), api=FrameworkAPI.from_handle(handle),
                          generation=generation)
        for n in prompts:
            sched.add_request(list(range(n)), max_new_tokens=DECODE_STEPS + 1)
        while sched.has_work():
            sched.poison()  # freed blocks and null blocks hold NaN before every step
            step = sched.next_step()
            if check is not None:
                check(sched, step)
            for i, layer in enumerate(layers):
                err = model.step(layer, step.request_ids, step.position_ids, step.q_lens, step.forward_metadata)
                errors.append((f"step {step.index} {'prefill' if step.is_prefill else 'decode'} layer {i}", err))
            sched.complete_step(step, [0] * len(step.request_ids))
    return errors


def run_standalone(case, prompts=None) -> list[tuple[str, float]]:
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    manifest = load_manifest(case.dir / golden.MANIFEST_FILE)
    prompts = prompts or default_prompts(manifest)
    errors = []
    with install_emulation():
        code = import_rendered(case.dir)
        model = Model(manifest)
        layers = _layers(code, model, manifest)
        runner = type("RunnerUnderTest", (code.runner_mixin(),), {})()
        runner._init_kvcache([layer.attn for layer in layers], len(prompts), MAX_LEN, cache_dtype=torch.float32)
        for layer in layers:  # nothing is written yet: any read of an unwritten slot shows up as NaN
            for name in ("k_cache", "v_cache", "nope_cache", "rope_cache"):
                if hasattr(layer.attn, name):
                    getattr(layer.attn, name).fill_(math.nan)
        rows = list(range(len(prompts)))
        for index in range(DECODE_STEPS + 1):
            prefill = index == 0
            fm = runner._build_forward_metadata(rows, list(prompts)) if prefill else runner._build_forward_metadata(rows)
            if prefill:
                positions, q_lens = torch.cat([torch.arange(n) for n in prompts]), list(prompts)
            else:
                positions, q_lens = runner.kv_len.clone(), [1] * len(rows)
            for i, layer in enumerate(layers):
                err = model.step(layer, rows, positions, q_lens, fm)
                errors.append((f"step {index} {'prefill' if prefill else 'decode'} layer {i}", err))
            runner._advance_kv_len(rows, fm)
        assert runner.kv_len.tolist() == [n + DECODE_STEPS for n in prompts]
    return errors


class SlidOut:
    """Records, per request, whether its first sliding block was real at prefill and null later."""

    def __init__(self):
        self.first_block: dict[int, list[bool]] = {}

    def __call__(self, sched, step):
        tables = step.forward_metadata.block_table
        if "SlidingWindow" in tables:
            null = step.null_blocks["SlidingWindow"]
            for row, rid in enumerate(step.request_ids):
                self.first_block.setdefault(rid, []).append(int(tables["SlidingWindow"][row, 0]) == null)

    def freed_during_decode(self) -> bool:
        return any(not seen[0] and seen[-1] for seen in self.first_block.values())


@pytest.mark.parametrize("model, mode", _params())
def test_rendered_paged_attention_matches_dense_reference(model, mode):
    case = _case(model, mode)
    slid = SlidOut()
    errors = run_standalone(case) if mode == "standalone" else run_framework(case, check=slid)
    if mode != "standalone" and model in ("gpt_oss", "mistral"):
        # The scenario really exercises both null-block situations of the sliding group.
        assert slid.freed_during_decode(), slid.first_block
        assert any(seen[0] for seen in slid.first_block.values()), slid.first_block
    assert len(errors) >= DECODE_STEPS + 1
    worst = max(errors, key=lambda e: e[1])
    assert worst[1] <= TOL, f"{case.id}: max |rendered - reference| = {worst[1]:.3g} at {worst[0]}"


TWO_LONG = (200, 200)  # both longer than block + window: both prefill tables start with the null block


def test_standalone_sliding_prefill_of_two_long_prompts_matches():
    errors = run_standalone(_case("gpt_oss", "standalone"), TWO_LONG)
    assert max(e for _, e in errors) <= TOL


def test_framework_sliding_prefill_of_two_long_prompts_in_one_step():
    """Both prompts' slid-out blocks map to the shared null block: the sliding prefill must not read them."""
    def both_tables_start_with_the_null_block(sched, step):
        if step.is_prefill:
            table = step.forward_metadata.block_table["SlidingWindow"]
            null = step.null_blocks["SlidingWindow"]
            assert table[:, 0].tolist() == [null, null], (table[:, :2], null)

    errors = run_framework(_case("gpt_oss", "framework_g2"), TWO_LONG, check=both_tables_start_with_the_null_block)
    worst = max(errors, key=lambda e: e[1])
    assert worst[1] <= TOL, worst


def run_legacy_standalone(case_dir: Path, batch: int = 2, prompt: int = 70) -> list[tuple[str, float]]:
    """Mode 1 (contiguous BSH cache, scatter_update_ at the runner's kv_len): per step and layer, the largest
    difference from the dense reference. ``prompt`` > WINDOW: the sliding layer's window cuts the prefill and
    every decode."""
    from model_infer_kvcache.analyzer.manifest_io import load_manifest
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    manifest = load_manifest(case_dir / golden.MANIFEST_FILE)
    errors = []
    with install_emulation():
        code = import_rendered(case_dir)
        model = Model(manifest)
        layers = _layers(code, model, manifest)
        runner = type("RunnerUnderTest", (code.runner_mixin(),), {})()
        runner._init_kvcache([layer.attn for layer in layers], batch, MAX_LEN, cache_dtype=torch.float32)
        for layer in layers:
            layer.attn.k_cache.fill_(math.nan)
            layer.attn.v_cache.fill_(math.nan)
        rows = list(range(batch))
        for index in range(DECODE_STEPS + 1):
            prefill = index == 0
            fm = runner._build_forward_metadata(prompt) if prefill else runner._build_forward_metadata()
            if prefill:
                positions, q_lens = torch.arange(prompt).repeat(batch), [prompt] * batch
            else:
                positions, q_lens = runner.kv_len.clone(), [1] * batch
            for i, layer in enumerate(layers):
                err = model.step(layer, rows, positions, q_lens, fm, bsh=True)
                errors.append((f"step {index} layer {i}", err))
            runner._advance_kv_len(fm)
        assert runner.kv_len.tolist() == [prompt + DECODE_STEPS] * batch
    return errors


def test_legacy_standalone_runner_matches_dense_reference():
    """Gemma-2's Legacy render: the model's own attention (soft-cap, per-kind window) over the runner's cache."""
    case = _case("gemma2_legacy", "standalone")
    text = (case.dir / "kvcache_attention.py").read_text(encoding="utf-8")
    assert "ATTN_LOGIT_SOFTCAPPING = 50.0" in text and "npu_fused_infer_attention_score" not in text
    worst = max(run_legacy_standalone(case.dir), key=lambda e: e[1])
    assert worst[1] <= TOL, worst


def test_legacy_render_without_the_soft_cap_leaves_the_reference(tmp_path):
    """Negative control: the same render with its soft-cap switched off is far from the soft-capped model."""
    import shutil

    case = _case("gemma2_legacy", "standalone")
    shutil.copytree(case.dir, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "kvcache_attention.py"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("ATTN_LOGIT_SOFTCAPPING = 50.0", "ATTN_LOGIT_SOFTCAPPING = None"), encoding="utf-8")
    worst = max(run_legacy_standalone(tmp_path, prompt=70), key=lambda e: e[1])
    assert worst[1] > 100 * TOL, worst


def _legacy_fa_sliding_render(tmp_path: Path) -> Path:
    """Mistral kept Legacy on request (--kv-mode legacy): every layer sliding, one BSH FA call each."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered

    m = analyze(AnalyzeRequest(config=str(ROOT / "tests" / "fixtures" / "configs" / "mistral_7b_v01.json"),
                               deploy_mode="standalone", kv_mode="legacy"))
    assert m.legacy_attention.kernel == "fa" and all(layer.is_sliding for layer in m.layers)
    (tmp_path / golden.MANIFEST_FILE).write_text(m.to_json(), encoding="utf-8")
    write_rendered(render_manifest(m), tmp_path)
    return tmp_path


@pytest.mark.parametrize("band", ["honoured", "ignored"])
def test_legacy_fa_decode_bounds_its_keys_whatever_the_band_reading(tmp_path, band):
    """The Legacy BSH decode slices the last W keys itself: right whether or not FA honours the band at q_len 1."""
    from model_infer_kvcache.validators.npu_ops import DeviceReadings, device_readings

    rendered = _legacy_fa_sliding_render(tmp_path)
    with device_readings(DeviceReadings(band_at_single_query=band)):
        worst = max(run_legacy_standalone(rendered, prompt=90), key=lambda e: e[1])
    assert worst[1] <= TOL, worst


def test_legacy_fa_decode_without_the_slice_needs_the_band(tmp_path):
    """Negative control: the same decode reading the whole cache is wrong once the band is ignored at q_len 1."""
    from model_infer_kvcache.validators.npu_ops import DeviceReadings, device_readings

    rendered = _legacy_fa_sliding_render(tmp_path)
    path = rendered / "kvcache_attention.py"
    text = path.read_text(encoding="utf-8")
    sliced = "k_cache, v_cache, kv_lens = k_cache[:, start:], v_cache[:, start:], kv_lens - start"
    assert sliced in text
    path.write_text(text.replace(sliced, "pass"), encoding="utf-8")
    with device_readings(DeviceReadings(band_at_single_query="honoured")):
        assert max(e for _, e in run_legacy_standalone(rendered, prompt=90)) <= TOL
    with device_readings(DeviceReadings(band_at_single_query="ignored")):
        worst = max(run_legacy_standalone(rendered, prompt=90), key=lambda e: e[1])
    assert worst[1] > 100 * TOL, worst


@pytest.mark.parametrize("reading", ["inclusive"])  # 'exclusive' is the goldens' reading, tested above
def test_window_offset_follows_the_manifests_reading(tmp_path, reading):
    """pre_tokens = W - WINDOW_PRE_TOKENS_OFFSET admits W keys under the reading the manifest was made for."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
    from model_infer_kvcache.implementer.render import render_manifest, write_rendered
    from model_infer_kvcache.validators.npu_ops import DeviceReadings, device_readings

    m = analyze(AnalyzeRequest(config=str(ROOT / "tests" / "fixtures" / "configs" / "gpt_oss_20b.json"),
                               deploy_mode="standalone", window_reading=reading))
    (tmp_path / golden.MANIFEST_FILE).write_text(m.to_json(), encoding="utf-8")
    write_rendered(render_manifest(m), tmp_path)
    offset = {"exclusive": 1, "inclusive": 0}[reading]
    assert f"WINDOW_PRE_TOKENS_OFFSET = {offset}" in (tmp_path / "kvcache_attention.py").read_text()
    with device_readings(DeviceReadings(window_pre_tokens=reading)):
        errors = run_standalone(types.SimpleNamespace(dir=tmp_path, id=f"gpt_oss/{reading}"))
    assert max(e for _, e in errors) <= TOL
