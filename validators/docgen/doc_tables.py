"""Tables in SKILL.md / references/ that are generated from the code, and the doc-vs-code checks.

The agent-facing docs carry a few tables whose every cell is a decision the code makes: the
model-kind quick selection, the FA v1/v2 keyword map, the sparse_mode per path, the framework API
generations, the lint rule index. Each lives between markers

    <!-- kvcache:generated NAME -->
    ...table...
    <!-- /kvcache:generated NAME -->

and is produced here from the analyzer rules, the operator facts of ``analyzer.operators`` (the pinned
torch_npu schemas and the v1/v2 keyword table ``fa_facts.FA_KEYWORDS``), the harness generations and the lint registry. ``check_generated`` reports
every block whose text differs from what the code produces now (a rule changed without its
table, or a table edited by hand); ``write_generated`` rewrites them.

Other doc-vs-code checks that compare hand-written prose tables with the code (manifest fields
against the JSON Schema, validation check names against the validators, rule IDs against the
registry) are here too, so a test can run them on an edited copy of the docs.

    python -m model_infer_kvcache.validators.docgen.doc_tables --check     # exit 1 and list drift
    python -m model_infer_kvcache.validators.docgen.doc_tables --write     # regenerate the blocks in place
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model_infer_kvcache.analyzer.decisions_table import YES_NO
from model_infer_kvcache.analyzer.errors import OneLineArgumentParser
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.analyzer.kinds.formats import FORMATS, format_of_manifest
from model_infer_kvcache.analyzer.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW, is_windowed
from model_infer_kvcache.analyzer.operators import fa_facts
from model_infer_kvcache.analyzer.operators.schemas import accepted_keywords, default_text
from model_infer_kvcache.validators.pipeline.check_ids import CHECKS

ROOT = Path(__file__).resolve().parents[2]

# Docs that may hold generated blocks, and the blocks each must hold.
DOC_GLOBS = ("SKILL.md", "references/*.md")
REQUIRED_BLOCKS = {
    "SKILL.md": ("model-kinds", "fa-args", "sparse-paths"),
    "references/fa_operators.md": ("fa-args", "fa-keyword-sets", "sparse-paths"),
    "references/framework.md": ("framework-generations",),
    "references/errors.md": ("lint-rules",),
}

_BLOCK = re.compile(
    r"<!-- kvcache:generated (?P<name>[a-z0-9-]+) -->\n(?P<body>.*?)<!-- /kvcache:generated (?P=name) -->",
    re.DOTALL,
)


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [_row(header), "|" + "---|" * len(header)]
    lines += [_row(r) for r in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- model kinds


@dataclass(frozen=True)
class ModelKind:
    key: str
    label: str
    examples: str
    config: dict
    kv_mode: str | None = None  # --kv-mode of the request (None: the analyzer decides)


_BASE = {
    "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 4, "torch_dtype": "bfloat16", "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}

# Minimal configs, one per model kind the docs name. They go through the real loader and the real
# analyzer, so the table shows what `kvcache analyze` decides for such a model today.
MODEL_KINDS: tuple[ModelKind, ...] = (
    ModelKind("gqa", "标准 MHA / GQA / MQA(含 MoE)", "Qwen3、Llama-3.1、GLM-4.5",
              {**_BASE, "model_type": "qwen3"}),
    ModelKind("sliding", "所有层都是滑窗", "Mistral-7B-v0.1、Phi-3-mini",
              {**_BASE, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}),
    ModelKind("window_covers_context", "滑窗长度 >= 上下文长度(等价全注意力)", "Phi-3.5-MoE",
              {**_BASE, "model_type": "phimoe", "sliding_window": 4096}),
    ModelKind("mixed_sinks", "滑窗 + 全注意力混合,带 sinks", "gpt-oss",
              {**_BASE, "model_type": "gpt_oss", "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ModelKind("mixed", "滑窗 + 全注意力混合,无 sinks", "Gemma-3、Qwen2/3 开启 use_sliding_window",
              {**_BASE, "model_type": "qwen3", "sliding_window": 1024,
               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # one row per attention format beyond GQA, from the format's own module (analyzer/kinds: doc_example)
    *(ModelKind(fmt.name, *fmt.doc_example[:2], {**_BASE, **fmt.doc_example[2]}) for fmt in FORMATS
      if fmt.doc_example),
    ModelKind("per_layer_shape", "滑窗 + 全注意力混合,full 层 head_dim / KV 头数不同", "Gemma-4(26B-A4B)",
              {**_BASE, "model_type": "gemma4_text", "sliding_window": 1024, "num_hidden_layers": 6,
               "global_head_dim": 128, "num_global_key_value_heads": 1, "attention_k_eq_v": True}),
    ModelKind("softcap", "attention logit soft-capping", "Gemma-2",
              {**_BASE, "model_type": "gemma2", "sliding_window": 4096, "max_position_embeddings": 8192,
               "attn_logit_softcapping": 50.0,
               "query_pre_attn_scalar": 256}),
    ModelKind("alibi", "ALiBi 位置偏置", "Falcon(alibi=true)、BLOOM",
              {**_BASE, "model_type": "falcon", "alibi": True}),
    ModelKind("chunked", "chunked local attention", "Llama-4",
              {**_BASE, "model_type": "llama4_text", "attention_chunk_size": 8192}),
    ModelKind("linear", "线性注意力 / 循环层混合(gated delta net、KDA、lightning、Mamba-2、Mamba-1、short conv、RWKV、mLSTM、RG-LRU、CCA)",
              "Qwen3-Next、Qwen3.5、Kimi-Linear、Ling-2.5、Granite-4.0-H、Bamba、Jamba、Falcon-H1、Zamba2、Zamba、LFM2、LFM3、"
              "RWKV-4、xLSTM、RecurrentGemma、ZAYA",
              {**_BASE, "model_type": "qwen3_next", "full_attention_interval": 4}),
    ModelKind("legacy_request", "标准 GQA,用户要求保留 Legacy(--kv-mode legacy)", "仅离线推理",
              {**_BASE, "model_type": "qwen3"}, kv_mode="legacy"),
)


def kind_manifest(key: str, framework_api: str | None = "G2", deploy_mode: str | None = None):
    """SelectionManifest the analyzer builds for one of MODEL_KINDS (used by the docs and their tests)."""
    from model_infer_kvcache.analyzer.build import AnalyzeRequest, assemble
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.analyzer.deploy_context import ProgressFacts, parse_dispatch

    kind = next(k for k in MODEL_KINDS if k.key == key)
    facts = normalize_config(kind.config, f"<doc kind {key}>")
    req = AnalyzeRequest(config=facts.path, kv_mode=kind.kv_mode, framework_api=framework_api,
                         deploy_mode=deploy_mode)
    return assemble(facts, ProgressFacts(), parse_dispatch(None), None, req)


def _attention_text(m) -> str:
    """The FA cell: the version, or (Legacy kernel 'model') the model's own attention and whether it renders."""
    from model_infer_kvcache.analyzer.errors import InputError
    from model_infer_kvcache.implementer.kinds import recurrent
    from model_infer_kvcache.implementer.render import render_manifest

    own = recurrent.doc_attention(m) or format_of_manifest(m).doc_attention(m)
    if own:
        return own
    if any(layer.head_dim is not None or layer.num_kv_heads_per_rank is not None for layer in m.layers):
        return f"{m.fa.version}(逐层形状:LAYER_SHAPES,每层按自己的 head_dim / KV 头数分配、写入、调 FA,两种部署模式已校验)"
    legacy = m.legacy_attention
    if legacy is None or legacy.kernel == "fa":
        return m.fa.version
    try:
        render_manifest(m, allow_blocked=True)
    except InputError:
        return "不用 FA:模型自身注意力(模板不渲染,手写)"
    return "不用 FA:模型自身 eager 注意力" + ("(含 soft-cap)" if legacy.softcap is not None else "") + ",已渲染"


def model_kinds_table() -> str:
    rows = []
    for kind in MODEL_KINDS:
        m = kind_manifest(kind.key)
        attn = " + ".join(sorted({layer.attn_type for layer in m.layers}))
        fmt = format_of_manifest(m)
        rows.append([kind.label, kind.examples, m.kv_mode.value, attn, _attention_text(m), fmt.doc_layout(m),
                     YES_NO[m.mla.absorb], YES_NO[m.mixed_attn_types], fmt.doc_write(m)])
    return _table(["模型形态", "例子", "KV 模式", "attn_type", "FA", "input_layout", "MLA absorb",
                   "混合 attn_type", "写入算子"], rows)


# --------------------------------------------------------------------------- FA v1 / v2


# Meaning of each FaKeywords field, in field order; a new field without a label fails generation
# (zip strict) and so the test.
_FA_MEANING = dict(zip(("op", *fa_facts.ROLES),
                       ("算子名", "softmax 缩放系数", "每卡 query 头数", "Q 实际长度", "KV 实际长度", "是否输出 softmax_lse"),
                       strict=True))
_SHARED_KEYWORDS = (("num_key_value_heads", "每卡 KV 头数"),)


def fa_args_table() -> str:
    from dataclasses import fields

    v1, v2 = fa_facts.FA_KEYWORDS["v1"], fa_facts.FA_KEYWORDS["v2"]
    rows = []
    for f in fields(v1):
        a, b = getattr(v1, f.name), getattr(v2, f.name)
        if f.name == "op":
            rows.append([_FA_MEANING[f.name], f"`{a}`", f"`{b}`", "—"])
            continue
        da, db = default_text(v1.op, a), default_text(v2.op, b)
        default = f"`{da}`" if da == db else f"v1 `{da}` / v2 `{db}`"
        rows.append([_FA_MEANING[f.name], f"`{a}`", f"`{b}`", default])
    for name, meaning in _SHARED_KEYWORDS:
        da, db = default_text(v1.op, name), default_text(v2.op, name)
        default = f"`{da}`" if da == db else f"v1 `{da}` / v2 `{db}`"
        rows.append([meaning, f"`{name}`", f"`{name}`", default])
    return _table(["含义", "FA v1", "FA v2", "漏传或名字写错时算子用的默认值"], rows)


def fa_keyword_sets() -> str:
    v1 = accepted_keywords(fa_facts.FA_OPS["v1"])
    v2 = accepted_keywords(fa_facts.FA_OPS["v2"])

    def names(items) -> str:
        return "、".join(f"`{n}`" for n in sorted(items))

    return (f"- 两版共有:{names(v1 & v2)}\n"
            f"- 只有 v1 接受:{names(v1 - v2)}\n"
            f"- 只有 v2 接受:{names(v2 - v1)}\n")


# --------------------------------------------------------------------------- sparse mode per path

_PROBE_WINDOW = 1000  # any window works: the table shows pre_tokens as W minus a constant


def _band_text(attn_type: str) -> str:
    from model_infer_kvcache.analyzer.device_questions import QUESTIONS
    from model_infer_kvcache.analyzer.rules import decide_window_tokens

    if not is_windowed(attn_type):
        pre, nxt, _ = decide_window_tokens(None)
        return f"{pre} / {nxt}"
    out = []
    for reading in QUESTIONS["window_pre_tokens"].readings:
        pre, nxt, _ = decide_window_tokens(_PROBE_WINDOW, reading)
        offset = _PROBE_WINDOW - pre
        out.append(f"{'W' if offset == 0 else f'W-{offset}' if offset > 0 else f'W+{-offset}'} / {nxt}"
                   f"({reading})")
    return ";".join(out)


def sparse_paths_table() -> str:
    from model_infer_kvcache.analyzer.config_loader import normalize_config
    from model_infer_kvcache.analyzer.rules import decide_mtp, decide_sparse

    paths = (
        ("标准 GQA/MHA/MQA,Paged TND", FULL_ATTENTION, False, "paged"),
        ("滑窗层,Paged TND", SLIDING_WINDOW, False, "paged"),
        ("MLA absorb,Paged TND_NTD", FULL_ATTENTION, True, "paged"),
        ("非滑窗层,Legacy BSH", FULL_ATTENTION, False, "legacy"),
        ("滑窗层,Legacy BSH", SLIDING_WINDOW, False, "legacy"),
    )
    rows = []
    for label, attn_type, is_mla, kv_mode in paths:
        sparse, mask, _ = decide_sparse(attn_type, is_mla, kv_mode)
        rows.append([label, f"{sparse.prefill} / {mask.prefill}", f"{sparse.decode} / {mask.decode}",
                     _band_text(attn_type)])
    mla = next(k for k in MODEL_KINDS if k.key == "mla")
    mtp = decide_mtp(normalize_config(mla.config, "<doc kind mla>"))
    rows.append(["MTP 推测解码的 decode(q_len = 1 + next_n,非滑窗层)", "同所在路径",
                 f"{mtp.decode_sparse_mode} / {mtp.decode_mask}", _band_text(FULL_ATTENTION)])
    return _table(["路径", "prefill sparse_mode / mask", "decode sparse_mode / mask",
                   "pre_tokens / next_tokens"], rows)


# --------------------------------------------------------------------------- framework generations


def framework_generations_table() -> str:
    from model_infer_kvcache.validators.harness.generations import GENERATIONS, field_names, get_generation

    rows = []
    for name in GENERATIONS:
        g = get_generation(name)
        rows.append([name, ", ".join(f"`{f}`" for f in field_names(g.CacheEntry)),
                     ", ".join(f"`{f}`" for f in field_names(g.ModelCacheInfo)),
                     "是" if g.model_level_block_size else "否(在每个 CacheEntry 上)",
                     "是" if g.has_is_mla_backend else "否",
                     f"`{g.table_key}`"])
    return _table(["代际", "CacheEntry 字段", "ModelCacheInfo 字段", "模型级 block_size",
                   "有 is_mla_backend", "block_table / slot_mapping 的键"], rows)


# --------------------------------------------------------------------------- lint rules


def lint_rules_table() -> str:
    from model_infer_kvcache.validators.lint.registry import RULES

    rows = [[f"[{r.id}](#{r.id.lower()})", f"`{r.name}`", r.title, "是" if r.needs_manifest else ""]
            for r in RULES.values()]
    return _table(["ID", "name", "查什么", "需要 --manifest"], rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "model-kinds": model_kinds_table,
    "fa-args": fa_args_table,
    "fa-keyword-sets": fa_keyword_sets,
    "sparse-paths": sparse_paths_table,
    "framework-generations": framework_generations_table,
    "lint-rules": lint_rules_table,
}


# --------------------------------------------------------------------------- block check / write


def doc_files(root: Path = ROOT) -> list[Path]:
    out: list[Path] = []
    for pattern in DOC_GLOBS:
        out += sorted(root.glob(pattern))
    return out


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every generated block in ``text``, in order."""
    return [(m.group("name"), m.group("body")) for m in _BLOCK.finditer(text)]


def check_generated(root: Path = ROOT, generators: dict[str, Callable[[], str]] | None = None) -> list[str]:
    """Every generated block that differs from the code, every unknown or missing block (empty: no drift)."""
    generators = generators or GENERATORS
    cache: dict[str, str] = {}
    problems: list[str] = []
    for path in doc_files(root):
        rel = path.relative_to(root).as_posix()
        found = blocks(path.read_text(encoding="utf-8"))
        names = [name for name, _ in found]
        for want in REQUIRED_BLOCKS.get(rel, ()):
            if want not in names:
                problems.append(f"{rel}: missing generated block {want!r}")
        for name, body in found:
            if name not in generators:
                problems.append(f"{rel}: unknown generated block {name!r}")
                continue
            if name not in cache:
                cache[name] = generators[name]()
            if body != cache[name]:
                problems.append(f"{rel}: block {name!r} differs from the code:\n{_first_diff(body, cache[name])}")
    for rel in REQUIRED_BLOCKS:
        if not (root / rel).is_file():
            problems.append(f"{rel}: file missing")
    return problems


def _first_diff(doc: str, code: str) -> str:
    a, b = doc.splitlines(), code.splitlines()
    for i in range(max(len(a), len(b))):
        left = a[i] if i < len(a) else "<none>"
        right = b[i] if i < len(b) else "<none>"
        if left != right:
            return f"  doc : {left}\n  code: {right}"
    return "  (whitespace only)"


def write_generated(root: Path = ROOT) -> list[Path]:
    """Rewrite every generated block from the code; returns the files that changed."""
    changed = []
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")

        def fill(m: re.Match) -> str:
            name = m.group("name")
            if name not in GENERATORS:
                return m.group(0)
            return (f"<!-- kvcache:generated {name} -->\n{GENERATORS[name]()}"
                    f"<!-- /kvcache:generated {name} -->")

        new = _BLOCK.sub(fill, text)
        if new != text:
            atomic_write_text(path, new)
            changed.append(path)
    return changed


# --------------------------------------------------------------------------- manifest fields


def _deref(node: dict, defs: dict) -> dict:
    if "$ref" in node:
        return defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _type_text(node: dict, defs: dict) -> str:
    options = node.get("anyOf", [node])
    nullable = any(o.get("type") == "null" for o in options)
    texts = []
    for o in options:
        if o.get("type") == "null":
            continue
        if "$ref" in o:
            texts.append("object")
        elif "enum" in o:
            texts.append("enum(" + ", ".join(str(v) for v in o["enum"]) + ")")
        elif "const" in o:
            texts.append(f"const({o['const']})")
        elif o.get("type") == "array":
            item = o.get("items", {})
            texts.append("array<" + ("object" if "$ref" in item or "oneOf" in item else _type_text(item, defs)) + ">")
        elif o.get("type") == "object":
            texts.append("object")
        else:
            texts.append(o.get("type", "any"))
    text = " or ".join(texts) or "any"
    return text + ("?" if nullable else "")


def manifest_fields(schema: dict) -> list[tuple[str, str, bool]]:
    """(dotted path, type text, required) of every field of the manifest JSON Schema, depth first.

    Array items are written ``name[]``; a field of one member of a tagged union of items ``name[<member>]`` (the
    member's title without its common suffix: ``layers[attention]``, ``layers[state]``), a field all members share
    alike ``name[]``; ``?`` marks a nullable type.
    """
    defs = schema.get("$defs", {})
    out: list[tuple[str, str, bool]] = []

    def walk(node: dict, prefix: str) -> None:
        node = _deref(node, defs)
        required = set(node.get("required", ()))
        for name, prop in node.get("properties", {}).items():
            path = f"{prefix}{name}"
            out.append((path, _type_text(prop, defs), name in required))
            for option in prop.get("anyOf", [prop]):
                if "$ref" in option:
                    walk(option, path + ".")
                elif option.get("type") == "array" and "$ref" in option.get("items", {}):
                    walk(option["items"], path + "[].")
                elif option.get("type") == "array" and "oneOf" in option.get("items", {}):
                    union(option["items"]["oneOf"], path)

    def union(members: list[dict], path: str) -> None:
        """A field every member has alike is written once (``name[].field``), the rest per member."""
        nonlocal out
        outer, per_member = out, {}
        for member in members:
            out = []
            walk(member, "\0")
            per_member[_member_name(_deref(member, defs))] = out
        out = outer
        shared = set.intersection(*(set(rows) for rows in per_member.values()))
        first = next(iter(per_member.values()))
        out += [(row[0].replace("\0", f"{path}[]."), *row[1:]) for row in first if row in shared]
        for name, rows in per_member.items():
            out += [(row[0].replace("\0", f"{path}[{name}]."), *row[1:]) for row in rows if row not in shared]

    walk(schema, "")
    return out


def _member_name(node: dict) -> str:
    """``AttentionLayerPlan`` -> ``attention``: a union member's title without the ``LayerPlan`` it shares."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", node.get("title", "").removesuffix("LayerPlan")).lower()


_FIELD_ROW = re.compile(r"^\|\s*`(?P<path>[a-z_][a-z0-9_.\[\]]*)`\s*\|\s*(?P<type>[^|]+?)\s*\|\s*(?P<req>[^|]*?)\s*\|")


def documented_fields(text: str) -> dict[str, tuple[str, str]]:
    """Field rows of references/manifest.md: path -> (type text, required cell)."""
    out = {}
    for line in text.splitlines():
        m = _FIELD_ROW.match(line)
        if m:
            out[m.group("path")] = (m.group("type").replace("\\|", "|").strip("` "), m.group("req"))
    return out


def check_manifest_doc(root: Path = ROOT) -> list[str]:
    schema = json.loads((root / "references" / "manifest.schema.json").read_text(encoding="utf-8"))
    doc = documented_fields((root / "references" / "manifest.md").read_text(encoding="utf-8"))
    problems = []
    for path, type_text, required in manifest_fields(schema):
        if path not in doc:
            problems.append(f"references/manifest.md: field `{path}` is not documented")
            continue
        got_type, got_req = doc[path]
        if got_type != type_text:
            problems.append(f"references/manifest.md: `{path}` type {got_type!r}, schema says {type_text!r}")
        if (got_req == "是") != required:
            problems.append(f"references/manifest.md: `{path}` required {got_req!r}, schema says "
                            f"{'是' if required else '否'}")
    known = {p for p, _, _ in manifest_fields(schema)}
    problems += [f"references/manifest.md: `{p}` is not a manifest field" for p in doc if p not in known]
    return problems


# --------------------------------------------------------------------------- validation checks


def validation_checks() -> set[tuple[str, str]]:
    """(link, name template) of every registered validation check (``validators/pipeline/check_ids.py``)."""
    return {(c.link, c.name) for c in CHECKS}


_CHECK_ROW = re.compile(r"^\|\s*(?P<id>V[0-9]{3})\s*\|\s*(?P<link>init|runtime|numeric|release)\s*\|"
                        r"\s*`(?P<name>(?:[^`])+)`\s*\|")


def documented_checks(text: str) -> set[tuple[str, str, str]]:
    """(ID, link, name template) of the check rows in references/validation.md (``\\|`` unescaped)."""
    return {(m.group("id"), m.group("link"), m.group("name").replace("\\|", "|"))
            for m in map(_CHECK_ROW.match, text.splitlines()) if m}


def check_validation_doc(root: Path = ROOT, checks=None) -> list[str]:
    """The doc's check table against the registry, row by row (ID, link and name)."""
    code = {(c.id, c.link, c.name) for c in (CHECKS if checks is None else checks)}
    doc = documented_checks((root / "references" / "validation.md").read_text(encoding="utf-8"))
    problems = [f"references/validation.md: check {cid} [{link}] `{name}` is not documented"
                for cid, link, name in sorted(code - doc)]
    problems += [f"references/validation.md: documents {cid} [{link}] `{name}`, which is not registered"
                 for cid, link, name in sorted(doc - code)]
    return problems


# --------------------------------------------------------------------------- rule IDs

_RULE_ID = re.compile(r"\bKV[1-8][0-9]{2}\b")
_RULE_HEADING = re.compile(r"^### (KV[0-9]{3})\b", re.MULTILINE)


def skill_error_table_ids(skill_text: str) -> list[str]:
    """Rule IDs named in SKILL.md's common-errors table (the table under a heading with 常见错误)."""
    section = re.search(r"^## [^\n]*常见错误[^\n]*\n(?P<body>.*?)(?=^## |\Z)", skill_text, re.MULTILINE | re.DOTALL)
    if not section:
        return []
    rows = [line for line in section.group("body").splitlines() if line.startswith("|")]
    return [rid for line in rows for rid in _RULE_ID.findall(line)]


def check_rule_book(root: Path = ROOT, rule_ids: list[str] | None = None) -> list[str]:
    from model_infer_kvcache.validators.lint.registry import RULES

    ids = list(rule_ids if rule_ids is not None else RULES)
    book = (root / "references" / "errors.md").read_text(encoding="utf-8")
    headings = _RULE_HEADING.findall(book)
    problems = [f"references/errors.md: no section for rule {rid}" for rid in ids if rid not in headings]
    problems += [f"references/errors.md: section {rid} names no registered rule" for rid in headings if rid not in ids]
    skill = (root / "SKILL.md").read_text(encoding="utf-8")
    named = skill_error_table_ids(skill)
    if not named:
        problems.append("SKILL.md: the 常见错误 table names no rule ID")
    problems += [f"SKILL.md: error table names unknown rule {rid}" for rid in named if rid not in ids]
    for rel in [p.relative_to(root).as_posix() for p in doc_files(root)]:
        text = (root / rel).read_text(encoding="utf-8")
        problems += [f"{rel}: names unknown rule {rid}" for rid in sorted(set(_RULE_ID.findall(text))) if rid not in ids]
    return problems


def check_all(root: Path = ROOT) -> list[str]:
    return check_generated(root) + check_manifest_doc(root) + check_validation_doc(root) + check_rule_book(root)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="python -m model_infer_kvcache.validators.docgen.doc_tables",
                              description="Check (or regenerate) the code-derived tables of SKILL.md and references/.")
    p.add_argument("--check", action="store_true", help="only check (the default; exit 1 on drift)")
    p.add_argument("--write", action="store_true", help="rewrite the generated blocks in place, then check")
    p.add_argument("--root", default=str(ROOT), help="bundle root (default: this checkout)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.root)
    if args.write:
        for path in write_generated(root):
            print(f"rewrote {path}")
    problems = check_all(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
