"""AST checks of the rendered code against the manifest it came from (every golden case).

The golden files equal a fresh render (tests/test_implementer_golden.py), so these checks hold
for what ``kvcache render`` produces. Each check reads the manifest, not the template: a
template that drifts from the manifest's decisions fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from model_infer_kvcache.analyzer.build import AnalyzeRequest, analyze
from model_infer_kvcache.analyzer.manifest_io import load_manifest
from model_infer_kvcache.analyzer.operators.fa_facts import FA_KEYWORDS, FA_OPS, INT32_MAX
from model_infer_kvcache.analyzer.operators.schemas import accepted_keywords, op_schema
from model_infer_kvcache.implementer.render import render_manifest

ROOT = Path(__file__).resolve().parent.parent
FA_OPS = (FA_OPS["v1"], FA_OPS["v2"])
WRITE_OPS = ("npu_scatter_nd_update_", "npu_kv_rmsnorm_rope_cache", "scatter_update_")
# The keyword each version spells for the renamed arguments the templates pass: scale / query heads /
# Q lengths / KV lengths (references/fa_operators.md, 'v1 与 v2 的参数名').
VERSION_NAMES = {version: {kw.scale, kw.num_heads, kw.q_lens, kw.kv_lens} for version, kw in FA_KEYWORDS.items()}


def _golden_module():
    """tests/golden/regenerate.py (the case table), loaded once by path: tests/ is not a package."""
    if "golden_regenerate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("golden_regenerate", ROOT / "tests" / "golden" / "regenerate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["golden_regenerate"] = module
        spec.loader.exec_module(module)
    return sys.modules["golden_regenerate"]


golden = _golden_module()
CASES = {case.id: case for case in golden.CASES}
PY_FILES = [(case.id, p.name) for case in golden.CASES for p in sorted(case.dir.glob("*.py"))]


@cache
def manifest(case_id: str):
    return load_manifest(CASES[case_id].dir / golden.MANIFEST_FILE)


def own_attention(m) -> bool:
    """A Legacy render that keeps the model's own attention (FA cannot express it): no FA call to check."""
    return m.legacy_attention is not None and m.legacy_attention.kernel == "model"


FA_CASES = [cid for cid in CASES if not own_attention(manifest(cid))]
OWN_ATTENTION_CASES = [cid for cid in CASES if own_attention(manifest(cid))]


@cache
def tree(case_id: str, name: str = "kvcache_attention.py") -> ast.Module:
    path = CASES[case_id].dir / name
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def constants(module: ast.Module) -> dict[str, object]:
    """Module-level NAME = <literal> assignments."""
    out = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def npu_calls(module: ast.Module, ops=None) -> list[ast.Call]:
    """Calls of ``torch_npu.<op>``."""
    return [n for n in ast.walk(module) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch_npu"
            and (ops is None or n.func.attr in ops)]


def kwargs(call: ast.Call) -> dict[str, ast.expr]:
    assert all(k.arg for k in call.keywords), f"line {call.lineno}: **kwargs hides argument names"
    return {k.arg: k.value for k in call.keywords}


def functions(module: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)}


def layer_plan(m, attn_type: str):
    return next(layer for layer in m.layers if layer.attn_type == attn_type)


def paths(m):
    """(attn_type, is_prefill) of every kind/path the manifest has."""
    return [(kind, prefill) for kind in sorted({layer.attn_type for layer in m.layers}) for prefill in (True, False)]


# ----------------------------------------------------------------------------- symbolic walk of the branches


_VERIFY_TEST = re.compile(r"(query|query_states)\.shape\[0\] > forward_metadata\.actual_seq_lengths_kv\.shape\[0\]")


def _condition(test: ast.expr, attn_type: str, is_prefill: bool, verify: bool = False) -> bool:
    text = ast.unparse(test)
    if text == "forward_metadata.is_prefill":
        return is_prefill
    if text == "self.sliding_window and (not forward_metadata.is_prefill)":  # Legacy decode slices the window
        return attn_type == "SlidingWindow" and not is_prefill
    if _VERIFY_TEST.fullmatch(text):  # more query tokens than requests: a speculative-decode verify step
        return verify
    if (isinstance(test, ast.Compare) and ast.unparse(test.left) == "self.attn_type" and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)):
        return attn_type == test.comparators[0].value
    raise AssertionError(f"line {test.lineno}: branch on {text!r} is not a layer-kind or prefill/decode branch")


def fa_arguments_on_path(func: ast.FunctionDef, attn_type: str, is_prefill: bool,
                         verify: bool = False) -> dict[str, ast.expr]:
    """The FA call's keyword values on one path, local names replaced by what that path assigned.

    ``verify``: a decode step with q_len = 1 + next_n (MTP speculative decoding).
    """
    env: dict[str, ast.expr] = {}
    found: list[dict[str, ast.expr]] = []

    def run(body):
        for stmt in body:
            if isinstance(stmt, ast.If):
                run(stmt.body if _condition(stmt.test, attn_type, is_prefill, verify) else stmt.orelse)
                continue
            calls = npu_calls(stmt, FA_OPS)
            if calls:
                found.append({k: env.get(v.id, v) if isinstance(v, ast.Name) else v
                              for k, v in kwargs(calls[0]).items()})
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                env[stmt.targets[0].id] = stmt.value

    run(func.body)
    assert len(found) == 1, f"{func.name}: {len(found)} FA calls on the {attn_type}/{is_prefill} path"
    return found[0]


def fa_function(module: ast.Module, attn_type: str = "FullAttention", is_prefill: bool = False) -> ast.FunctionDef:
    """The function whose FA call serves this layer kind on this path.

    Sliding layers prefill over the step's own K/V (``prefill_window_attention``); every other path
    reads the cache (``paged_attention`` / ``legacy_attention``).
    """
    owners = {f.name: f for f in functions(module).values() if npu_calls(f, FA_OPS)}
    if attn_type == "SlidingWindow" and is_prefill and "prefill_window_attention" in owners:
        return owners["prefill_window_attention"]
    cache_readers = [f for name, f in owners.items() if name != "prefill_window_attention"]
    assert len(cache_readers) == 1, list(owners)
    return cache_readers[0]


def expected_fa_calls(m) -> int:
    """One cache-reading FA call, plus the fresh-K/V prefill call when a paged model has sliding layers."""
    sliding = any(layer.attn_type == "SlidingWindow" for layer in m.layers)
    return 2 if sliding and m.kv_mode.value == "paged" else 1


# ----------------------------------------------------------------------------- compile, ruff, imports


@pytest.mark.parametrize("case_id, name", PY_FILES, ids=[f"{c}/{n}" for c, n in PY_FILES])
def test_rendered_code_compiles_and_uses_every_import(case_id, name):
    path = CASES[case_id].dir / name
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
    module = tree(case_id, name)
    imported = {}
    for node in ast.walk(module):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(module) if isinstance(n, ast.Name)}
    unused = {name: line for name, line in imported.items() if name not in used}
    assert not unused, f"{case_id}/{name}: unused imports {unused}"


def _ruff() -> list[str] | None:
    if shutil.which("ruff"):
        return ["ruff"]
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    return None


def test_fresh_renders_pass_ruff_with_the_project_rules(tmp_path):
    ruff = _ruff()
    # ruff is in the [test] extra: its absence is a broken test environment, not a reason to skip.
    assert ruff is not None, "ruff is not installed: pip install -e '.[test]'"
    for case in golden.CASES:
        rendered = render_manifest(manifest(case.id), allow_blocked=case.model.allow_blocked)
        folder = tmp_path / case.model.name / case.mode
        folder.mkdir(parents=True)
        for name, text in rendered.files.items():
            (folder / name).write_text(text, encoding="utf-8")
    files = sorted(str(p) for p in tmp_path.rglob("*.py"))
    assert len(files) == len(PY_FILES)
    result = subprocess.run([*ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *files],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- operator calls


@pytest.mark.parametrize("case_id", list(CASES))
def test_every_npu_call_uses_real_schema_names(case_id):
    module = tree(case_id)
    calls = npu_calls(module)
    assert calls
    for call in calls:
        op = call.func.attr
        schema = op_schema(op)
        assert set(kwargs(call)) <= accepted_keywords(op), (op, set(kwargs(call)) - accepted_keywords(op))
        positional = [a for a in schema["args"] if not a["kwarg_only"]]
        assert len(call.args) <= len(positional), f"{op}: {len(call.args)} positional arguments"
        # A keyword must not repeat an argument already given by position.
        assert not {a["name"] for a in positional[: len(call.args)]} & set(kwargs(call)), op


@pytest.mark.parametrize("case_id", FA_CASES)
def test_fa_call_uses_only_its_versions_argument_names(case_id):
    m = manifest(case_id)
    module = tree(case_id)
    calls = npu_calls(module, FA_OPS)
    assert len(calls) == expected_fa_calls(m)
    for call in calls:
        want_op = FA_OPS[1] if m.fa.version == "v2" else FA_OPS[0]
        assert call.func.attr == want_op
        names = set(kwargs(call))
        v1_only = accepted_keywords(FA_OPS[0]) - accepted_keywords(FA_OPS[1])
        v2_only = accepted_keywords(FA_OPS[1]) - accepted_keywords(FA_OPS[0])
        assert VERSION_NAMES["v1"] <= v1_only and VERSION_NAMES["v2"] | {"learnable_sink"} <= v2_only  # schema
        if m.fa.version == "v2":
            assert not names & v1_only, names & v1_only
        else:
            assert not names & v2_only, names & v2_only
        assert VERSION_NAMES[m.fa.version] <= names, VERSION_NAMES[m.fa.version] - names
        assert ("learnable_sink" in names) == m.model.has_sinks
        assert len(call.args) == 3  # query, key, value


@pytest.mark.parametrize("case_id", FA_CASES)
def test_fa_scale_heads_and_layout_come_from_the_manifest(case_id):
    m = manifest(case_id)
    module = tree(case_id)
    consts = constants(module)
    calls = npu_calls(module, FA_OPS)
    cache_calls = [c for c in calls if m.kv_mode.value == "legacy" or "block_table" in kwargs(c)]
    assert len(cache_calls) == 1
    kw = kwargs(cache_calls[0])
    for fresh in (c for c in calls if c not in cache_calls):  # sliding prefill over this step's K/V
        fkw = kwargs(fresh)
        # No block table: the KV is packed like the query, so its lengths are cumulative too.
        assert ast.unparse(fkw[FA_KEYWORDS[m.fa.version].kv_lens]) == "forward_metadata.actual_seq_lengths_cu_kv"
        assert "block_size" not in fkw
    scale_kw, heads_kw = FA_KEYWORDS[m.fa.version].scale, FA_KEYWORDS[m.fa.version].num_heads
    assert ast.unparse(kw[scale_kw]) == "SOFTMAX_SCALE" and consts["SOFTMAX_SCALE"] == m.fa.softmax_scale
    assert ast.unparse(kw[heads_kw]) == "NUM_HEADS_PER_RANK"
    assert consts["NUM_HEADS_PER_RANK"] == m.parallel.num_q_heads_per_rank
    layout = kw["input_layout"].value
    assert layout == ("BSH" if m.kv_mode.value == "legacy" else m.fa.input_layout)
    if m.mla.enabled:
        assert isinstance(kw["num_key_value_heads"], ast.Constant) and kw["num_key_value_heads"].value == 1
        assert {"query_rope", "key_rope"} <= set(kw)
    else:
        assert ast.unparse(kw["num_key_value_heads"]) == "NUM_KV_HEADS_PER_RANK"
        assert consts["NUM_KV_HEADS_PER_RANK"] == m.parallel.num_kv_heads_per_rank
        assert consts["HEAD_DIM"] == m.model.head_dim
    if m.kv_mode.value == "paged":
        q_lens, kv_lens = FA_KEYWORDS[m.fa.version].q_lens, FA_KEYWORDS[m.fa.version].kv_lens
        # TND: cumulative Q lengths, per-request paged KV lengths (references/fa_operators.md, '实际长度(actual_seq_lengths*)').
        assert ast.unparse(kw[q_lens]) == "forward_metadata.actual_seq_lengths_cu_q"
        assert ast.unparse(kw[kv_lens]) == "forward_metadata.actual_seq_lengths_kv"
        assert consts["BLOCK_SIZE"] == m.block_size


@pytest.mark.parametrize("case_id", FA_CASES)
def test_prefill_and_decode_pass_the_manifests_sparse_modes_per_layer_kind(case_id):
    m = manifest(case_id)
    module = tree(case_id)
    for attn_type, prefill in paths(m):
        func = fa_function(module, attn_type, prefill)
        plan = layer_plan(m, attn_type)
        mode = plan.sparse_mode.prefill if prefill else plan.sparse_mode.decode
        mask = plan.mask.prefill if prefill else plan.mask.decode
        got = fa_arguments_on_path(func, attn_type, prefill)
        where = f"{attn_type} {'prefill' if prefill else 'decode'}"
        assert isinstance(got["sparse_mode"], ast.Constant) and got["sparse_mode"].value == mode, where
        want_mask = "forward_metadata.attention_mask" if mask != "none" else "None"
        assert ast.unparse(got["atten_mask"]) == want_mask, where
        if mode == 4:
            assert ast.unparse(got["pre_tokens"]) == "self.window_pre_tokens", where
            assert ast.literal_eval(got["next_tokens"]) == plan.next_tokens, where
        else:
            assert ast.literal_eval(got["pre_tokens"]) == INT32_MAX, where
            assert ast.literal_eval(got["next_tokens"]) == 0, where


@pytest.mark.parametrize("case_id", FA_CASES)
def test_verify_steps_pass_the_manifests_mtp_plan(case_id):
    """Decode with q_len = 1 + next_n: non-sliding layers take the manifest's mtp sparse_mode and mask
    (DeepSeek-V3: 3 + causal mask, where q_len 1 keeps 0 without mask); other manifests, or sliding
    layers, run verify steps exactly like q_len 1 decode."""
    m = manifest(case_id)
    module = tree(case_id)
    for attn_type in sorted({layer.attn_type for layer in m.layers}):
        func = fa_function(module, attn_type, False)
        plan = layer_plan(m, attn_type)
        got = fa_arguments_on_path(func, attn_type, False, verify=True)
        if m.mtp is not None and m.kv_mode.value == "paged" and attn_type != "SlidingWindow":
            mode, mask = m.mtp.decode_sparse_mode, m.mtp.decode_mask
        else:
            mode, mask = plan.sparse_mode.decode, plan.mask.decode
        assert isinstance(got["sparse_mode"], ast.Constant) and got["sparse_mode"].value == mode, attn_type
        want_mask = "forward_metadata.attention_mask" if mask != "none" else "None"
        assert ast.unparse(got["atten_mask"]) == want_mask, attn_type
    if case_id.startswith("deepseek_v3/"):
        q_len_1 = fa_arguments_on_path(fa_function(module), "FullAttention", False)
        assert (q_len_1["sparse_mode"].value, ast.unparse(q_len_1["atten_mask"])) == (0, "None")


# ----------------------------------------------------------------------------- index tensors


def _parents(module: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(module) for child in ast.iter_child_nodes(parent)}


@pytest.mark.parametrize("case_id", list(CASES))
def test_block_table_and_slot_mapping_are_indexed_by_the_layers_key(case_id):
    m = manifest(case_id)
    module = tree(case_id)
    parents = _parents(module)
    reads = [n for n in ast.walk(module) if isinstance(n, ast.Attribute) and n.attr in ("block_table", "slot_mapping")
             and ast.unparse(n.value) == "forward_metadata"]
    if m.kv_mode.value == "legacy":
        assert not reads and all("block_table" not in kwargs(c) for c in npu_calls(module, FA_OPS))
        return
    assert {n.attr for n in reads} == {"block_table", "slot_mapping"}
    for node in reads:
        parent = parents[node]
        if m.deploy_mode.value == "framework":
            # A dict keyed by the layer's group: attn_type, which init_kv_cache sets per layer.
            assert isinstance(parent, ast.Subscript) and parent.value is node, f"line {node.lineno}: not indexed"
            assert ast.unparse(parent.slice) == "self.attn_type", f"line {node.lineno}: {ast.unparse(parent)}"
        else:
            assert not isinstance(parent, ast.Subscript), f"line {node.lineno}: standalone tables are tensors"
    assert {layer.group_key for layer in m.layers} == {layer.attn_type for layer in m.layers}


# ----------------------------------------------------------------------------- MLA


MLA_CASES = [cid for cid in CASES if manifest(cid).mla.enabled]


@pytest.mark.parametrize("case_id", MLA_CASES)
def test_mla_writer_takes_epsilon_and_gamma_from_the_norm_module(case_id):
    m = manifest(case_id)
    calls = npu_calls(tree(case_id), ("npu_kv_rmsnorm_rope_cache",))
    assert len(calls) == 1
    call = calls[0]
    kw = kwargs(call)
    eps = kw["epsilon"]
    assert isinstance(eps, ast.Attribute) and eps.attr in ("variance_epsilon", "eps"), ast.unparse(eps)
    gamma = call.args[1]
    assert isinstance(gamma, ast.Attribute) and gamma.attr == "weight"
    assert ast.unparse(eps.value) == ast.unparse(gamma.value) == "self.kv_a_layernorm"
    assert not [n for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, float)]
    assert kw["cache_mode"].value == m.mla.cache_mode == "PA_NZ"


@pytest.mark.parametrize("case_id", MLA_CASES)
def test_mla_fa_reads_the_latent_as_key_and_value_through_nz_views(case_id):
    module = tree(case_id)
    func = fa_function(module)
    call = npu_calls(func, FA_OPS)[0]
    key, value = (ast.unparse(a) for a in call.args[1:])
    assert key == value
    views = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            views[node.targets[0].id] = node.value
    for name, cache_attr, dim in ((key, "nope_cache", "KV_LORA_RANK"),
                                  (ast.unparse(kwargs(call)["key_rope"]), "rope_cache", "QK_ROPE_HEAD_DIM")):
        view = views[name]
        assert ast.unparse(view.func) == f"self.{cache_attr}.view", ast.unparse(view)
        assert len(view.args) == 5 and ast.unparse(view.args[2]) == f"{dim} // KV_CACHE_NZ_DIM"
    assert constants(module)["KV_CACHE_NZ_DIM"] == 16


# ----------------------------------------------------------------------------- cache entries per generation


def _entries_and_info(module: ast.Module):
    calls = [n for n in ast.walk(module) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return ([c for c in calls if c.func.id == "CacheEntry"], [c for c in calls if c.func.id == "ModelCacheInfo"])


def _check_generation(module: ast.Module, m, api: str) -> None:
    entries, infos = _entries_and_info(module)
    assert [kwargs(e)["cache_name"].value for e in entries] == [c.name for c in m.layers[0].caches]
    assert len(infos) == 1
    info = kwargs(infos[0])
    for entry in entries:
        kw = kwargs(entry)
        assert ("block_size" in kw) == (api == "G2"), api
        assert ast.unparse(kw["num_head"]) == ("1" if m.mla.enabled else "NUM_KV_HEADS_PER_RANK")
        assert ast.unparse(kw["attn_type"]) == "self.attn_type"
    assert ("block_size" in info) == (api != "G2"), api
    if api != "G2":
        assert ast.unparse(info["block_size"]) == "self.block_size"
    want_mla = m.mla.enabled and api != "G0"
    assert ("is_mla_backend" in info) == want_mla
    if want_mla:
        assert info["is_mla_backend"].value is True


@pytest.mark.parametrize("case_id", [cid for cid in CASES if manifest(cid).kv_mode.value == "paged"])
def test_cache_entries_follow_the_framework_generation(case_id):
    m = manifest(case_id)
    module = tree(case_id)
    if m.deploy_mode.value == "standalone":
        assert _entries_and_info(module) == ([], [])
        assert not [n for n in ast.walk(module) if isinstance(n, ast.ImportFrom) and "executor" in (n.module or "")]
        return
    _check_generation(module, m, m.framework_api)


@pytest.mark.parametrize("config", ["qwen3_8b", "deepseek_v3", "gpt_oss_20b"])
def test_g0_renders_have_model_level_block_size_and_no_mla_flag(config):
    m = analyze(AnalyzeRequest(config=str(ROOT / "tests" / "fixtures" / "configs" / f"{config}.json"),
                               deploy_mode="framework", framework_api="G0"))
    text = render_manifest(m).files["kvcache_attention.py"]
    _check_generation(ast.parse(text), m, "G0")


# ----------------------------------------------------------------------------- per-layer kind at init


@pytest.mark.parametrize("case_id", list(CASES))
def test_init_sets_each_layers_kind_window_and_band_from_the_manifest(case_id):
    from model_infer_kvcache.validators.harness import install_framework
    from model_infer_kvcache.validators.npu_ops import install_emulation
    from model_infer_kvcache.validators.pipeline.host_model import import_rendered

    m = manifest(case_id)
    framework = install_framework(m.framework_api) if m.deploy_mode.value == "framework" else None
    with install_emulation():
        if framework is not None:
            with framework:
                code = import_rendered(CASES[case_id].dir)
        else:
            code = import_rendered(CASES[case_id].dir)
        cls = type("Probe", (code.attention_mixin(),), {})
        for plan in m.layers:
            attn = cls()
            if framework is not None and m.kv_mode.value == "paged":
                with install_framework(m.framework_api):
                    attn.init_kv_cache(plan.index)
                assert {e.cache_name for e in attn.cache_entries} == {c.name for c in plan.caches}
                assert all(e.attn_type == plan.attn_type and e.sliding_window == plan.sliding_window
                           for e in attn.cache_entries)
            else:
                attn.init_kv_cache(plan.index)
            assert attn.attn_type == plan.attn_type == plan.group_key, plan.index
            assert attn.sliding_window == plan.sliding_window, plan.index
            if plan.attn_type == "SlidingWindow" and not own_attention(m):
                assert attn.window_pre_tokens == plan.pre_tokens, plan.index
            elif own_attention(m):  # the model's own attention masks the window itself: no FA band
                assert not hasattr(attn, "window_pre_tokens"), plan.index


# ----------------------------------------------------------------------------- Legacy attention


@pytest.mark.parametrize("case_id", OWN_ATTENTION_CASES)
def test_own_attention_render_calls_no_fa_and_applies_the_manifests_soft_cap(case_id):
    """FA cannot express the model's attention (Gemma-2's soft-cap): the render reads the cache with the model's
    own attention, capping the scaled scores with the manifest's value before the mask."""
    m = manifest(case_id)
    module = tree(case_id)
    consts = constants(module)
    assert npu_calls(module, FA_OPS) == []
    assert consts["ATTN_LOGIT_SOFTCAPPING"] == m.legacy_attention.softcap
    assert consts["SOFTMAX_SCALE"] == m.fa.softmax_scale
    assert "WINDOW_PRE_TOKENS_OFFSET" not in consts  # no FA band: the window is masked by the render itself
    func = functions(module)["legacy_attention"]
    tanh = [n for n in ast.walk(func) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.tanh"]
    assert len(tanh) == 1 and ast.unparse(tanh[0].args[0]) == "scores / ATTN_LOGIT_SOFTCAPPING"
    source = ast.unparse(func)
    assert "* SOFTMAX_SCALE" in source and "self.sliding_window" in source


LEGACY_FA_SLIDING = [cid for cid in FA_CASES if manifest(cid).kv_mode.value == "legacy"
                     and any(layer.is_sliding for layer in manifest(cid).layers)]


@pytest.mark.parametrize("case_id", LEGACY_FA_SLIDING)
def test_legacy_fa_decode_reads_only_the_window_it_slices(case_id):
    """The Legacy BSH decode of a sliding layer bounds its keys itself (band_at_single_query is open): the FA
    call reads the cache and KV lengths that the decode branch cut to the last W keys."""
    func = functions(tree(case_id))["legacy_attention"]
    branch = [n for n in ast.walk(func) if isinstance(n, ast.If)
              and ast.unparse(n.test) == "self.sliding_window and (not forward_metadata.is_prefill)"]
    assert len(branch) == 1
    body = "\n".join(ast.unparse(stmt) for stmt in branch[0].body)
    assert "start = max(int(kv_lens.min()) - self.sliding_window, 0)" in body
    assert "k_cache, v_cache, kv_lens = (k_cache[:, start:], v_cache[:, start:], kv_lens - start)" in body
    call = npu_calls(func, FA_OPS)[0]
    assert [ast.unparse(a) for a in call.args[1:]] == ["k_cache", "v_cache"]
    assert ast.unparse(kwargs(call)[FA_KEYWORDS[manifest(case_id).fa.version].kv_lens]) == "kv_lens"
