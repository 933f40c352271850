"""The code-only rules (no manifest needed): one pass over a parsed file.

Every rule reports only what is certain from the code: a value is followed to where it is set,
per prefill/decode and sliding branch, and a rule fires on a branch only when the value there is
known. Unknown values (parameters, attributes set elsewhere) never produce a finding.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

from model_infer_kvcache.analyzer.operators.fa_facts import COMPRESSED_MASK_MODES, COMPRESSED_MASK_SHAPES
from model_infer_kvcache.validators.lint import ops
from model_infer_kvcache.validators.lint.deploy_mode import (
    AUTO,
    FRAMEWORK,
    Decision,
    FolderFacts,
    decide,
    file_facts,
)
from model_infer_kvcache.validators.lint.graph_checks import GraphChecks
from model_infer_kvcache.validators.lint.hidden_layout import HiddenLayout
from model_infer_kvcache.validators.lint.kwargs_dicts import call_keywords, dict_keys, expand_star_kwargs
from model_infer_kvcache.validators.lint.masks import MaskFacts
from model_infer_kvcache.validators.lint.registry import RULES
from model_infer_kvcache.validators.lint.scope import DECODE, PREFILL, Ctx, ModuleInfo, _ident_text
from model_infer_kvcache.validators.lint.standalone_checks import StandaloneChecks
from model_infer_kvcache.validators.lint.target_release import Target
from model_infer_kvcache.validators.lint.values import (
    Resolver,
    Variant,
    as_int,
    as_number,
    as_str,
    dict_item_key,
    is_none,
)

MISSING = ast.Constant(value=Ellipsis)  # marker: argument not passed (the op default applies)
OPAQUE = ast.Constant(value=NotImplemented)  # marker: may be passed through **kwargs

_DICT_FIELDS = {"block_table": "KV301", "slot_mapping": "KV302"}
_STRIP_METHODS = {"view", "reshape", "to", "int", "long", "contiguous", "flatten", "unsqueeze", "squeeze",
                  "npu", "cuda", "clone"}
_RAW_KV_HEAD_NAMES = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                      "num_key_value_heads_total"}
_INPLACE_METHODS = {"add_", "sub_", "copy_", "fill_", "zero_", "mul_", "index_add_", "clamp_", "masked_fill_",
                    "__iadd__", "__isub__"}


@dataclass(frozen=True)
class FaCallCase:
    """One way an FA call runs: context plus the resolved sparse_mode / mask values."""

    ctx: Ctx
    sparse: int | None  # None: unknown
    sparse_origin: ast.AST | None  # where the sparse_mode value is written (None when not passed)
    mask: ast.AST  # MISSING / OPAQUE / expression
    mask_origin: ast.AST | None
    mask_at: ast.AST
    certain: bool

    @property
    def no_mask(self) -> bool:
        return self.mask is MISSING or is_none(self.mask)


def strip_methods(node: ast.AST) -> ast.AST:
    """``x.view(-1, 1).int()`` -> ``x`` (shape/dtype methods do not change what the value is)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STRIP_METHODS:
        node = node.func.value
    return node


def _terminal(node: ast.AST) -> str | None:
    return ops.terminal_name(node)


def _has_config_root(node: ast.AST) -> bool:
    text = _ident_text(node).split(".")
    return any("config" in part.lower() for part in text[:-1])


class FileChecker:
    def __init__(self, tree: ast.Module, path: str, manifest=None, release: Target | None = None, *,
                 mode: str = AUTO, folder: FolderFacts | None = None) -> None:
        self.tree = tree
        self.path = path
        self.manifest = manifest
        self.release = release or Target(ops.PINNED_RELEASE, "the pinned release")
        self.info = ModuleInfo(tree, path)
        self.resolver = Resolver(self.info)
        self.masks = MaskFacts(self.resolver)
        self.layout = HiddenLayout(self.info, self.resolver)
        for node in self.info.nodes:
            if isinstance(node, ast.Call):
                expand_star_kwargs(self.info, node)  # `**fa_kwargs` of a visible dict
        self.names, self.attrs = ops.collect_aliases(self.info.nodes)
        self.deploy, self.packed = self._deploy_mode(mode, folder)  # deploy_mode.Decision: (mode, reason)
        self.framework = self.deploy.mode == FRAMEWORK
        self.raw: list[tuple[str, ast.AST, dict]] = []  # (rule id, node, message fields)
        self._seen: set[tuple[str, int, int]] = set()
        # calls the manifest checks revisit: (call, op or class name)
        self.fa_calls: list[tuple[ast.Call, str]] = []
        self.entry_calls: list[ast.Call] = []
        self.cache_info_calls: list[ast.Call] = []
        self.fa_fired: dict[int, set[str]] = {}  # id(call) -> rules its sparse/mask checks raised

    # ------------------------------------------------------------ plumbing

    def emit(self, rule_id: str, node: ast.AST, **fields) -> None:
        key = (rule_id, getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if key in self._seen:
            return
        self._seen.add(key)
        self.raw.append((rule_id, node, fields))

    def _deploy_mode(self, forced: str, folder: FolderFacts | None) -> tuple[Decision, bool]:
        """(the file's deployment mode and why, framework *paged* code with packed [T, H] hidden states).

        The mode is ``deploy_mode.decide``'s (--mode, the manifest, the file's registration, a runner of
        its own in the file or its folder). Legacy code (``scatter_update_``, ``cache_unit``, or a Legacy
        manifest) keeps [B, S, H] even in framework mode.
        """
        manifest = self.manifest
        decision = decide(forced, manifest.deploy_mode.value if manifest is not None else None,
                          file_facts(self.tree, self.path), folder)
        legacy = manifest is not None and manifest.kv_mode.value == "legacy"
        for node in self.info.nodes:
            if isinstance(node, ast.Attribute) and node.attr in (ops.SCATTER_LEGACY, ops.SCATTER_LEGACY_OUT,
                                                                   "cache_unit"):
                legacy = True
                break
        return decision, decision.mode == FRAMEWORK and not legacy

    def _is_runner_code(self, node: ast.AST) -> bool:
        if os.path.basename(self.path).lower().startswith("runner"):
            return True
        cls = self.info.class_of(node)
        while cls is not None:
            if "runner" in cls.name.lower():
                return True
            cls = self.info.enclosing(cls, ast.ClassDef)
        return False

    # ------------------------------------------------------------ driver

    def run(self) -> list[tuple[str, ast.AST, dict]]:
        for node in self.info.nodes:
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, (ast.AugAssign, ast.Assign)):
                self._kv_len_assign(node)
        if self.deploy.mode != FRAMEWORK:  # the framework owns slots, cache allocation and lengths there
            StandaloneChecks(self).run()
        GraphChecks(self).run()
        return self.raw

    def _call(self, call: ast.Call) -> None:
        op = ops.call_op(call, self.names, self.attrs)
        if op in ops.FA_OPS:
            self.fa_calls.append((call, op))
            self.fa_call(call, op)
        elif op in ops.WRITER_OPS:
            self.writer_call(call, op)
        elif op in ops.DSA_OPS:
            self.dsa_call(call, op)
        name = _terminal(call.func)
        if name and name.endswith("CacheEntry") and "mamba" not in name.lower():
            self.entry_calls.append(call)
            self.cache_entry(call)
        elif name and name.endswith("ModelCacheInfo"):
            self.cache_info_calls.append(call)
        if isinstance(call.func, ast.Attribute):
            if call.func.attr in ("view", "reshape"):
                self.hidden_view(call)
            elif call.func.attr in _INPLACE_METHODS:
                self.kv_len_inplace(call, call.func.value)
        if name == "add" and any(kw.arg == "out" for kw in call.keywords):
            out = next(kw.value for kw in call.keywords if kw.arg == "out")
            self.kv_len_inplace(call, out)

    # ------------------------------------------------------------ argument variants

    def arg_variants(self, call: ast.Call, name: str, ctx: Ctx, star: bool) -> list[Variant]:
        named, _ = call_keywords(call)
        if name in named:
            return self.resolver.variants(named[name].value, call, ctx)
        return [Variant(ctx, OPAQUE if star else MISSING, True, call)]

    def call_cases(self, call: ast.Call, ctx: Ctx, star: bool) -> list[FaCallCase]:
        out = []
        for sv in self.arg_variants(call, "sparse_mode", ctx, star):
            sparse = 0 if sv.node is MISSING else as_int(sv.node)  # both ops default to 0
            if sparse is None and sv.node is not MISSING and sv.node is not OPAQUE:
                sparse = as_int(self._number_node(sv))
            for mv in self.arg_variants(call, "atten_mask", sv.ctx, star):
                if sv.via is not None and mv.via is not None and sv.via is not mv.via:
                    continue  # values from two different helper calls never meet
                out.append(FaCallCase(mv.ctx, sparse, sv.origin, mv.node, mv.origin, mv.at,
                                    sv.certain and mv.certain))
        return out

    def _number_node(self, v: Variant):
        value = self.resolver.number(v.node, v.at, v.ctx)
        return ast.Constant(value=value) if isinstance(value, int) else None

    def mla_kind(self, call: ast.Call, named: dict[str, ast.keyword]) -> str | None:
        """'absorb' (key = value = the latent cache), 'expanded' (MLA with per-head K/V), or None.

        MLA shows as query_rope/key_rope, an ``absorb`` function, or a ``nope`` key. Only the absorb
        form reads the single-head latent cache; the non-absorb prefill expands K/V per head
        (num_key_value_heads = query heads, its own layout), which the absorb rules must not judge.
        """
        key = call.args[1] if len(call.args) > 1 else (named["key"].value if "key" in named else None)
        value = call.args[2] if len(call.args) > 2 else (named["value"].value if "value" in named else None)
        absorb_name = any("absorb" in n.lower() for n in self.info.function_names(call))
        rope = any(r in named and not is_none(named[r].value) for r in ("query_rope", "key_rope"))
        nope_key = key is not None and "nope" in ast.unparse(key).lower()
        if not (rope or absorb_name or nope_key):
            return None
        same_kv = key is not None and value is not None and ast.dump(key) == ast.dump(value)
        return "absorb" if (same_kv or absorb_name) else "expanded"

    # ------------------------------------------------------------ FA calls

    def fa_call(self, call: ast.Call, op: str) -> None:
        named, star = call_keywords(call)
        wrong = ops.WRONG_VERSION_NAMES[op]
        wrong_id = "KV101" if op == ops.FA_V2 else "KV102"
        accepted = ops.accepted_keywords(op, self.release.release)
        for kw_name, kw in named.items():
            if kw_name in wrong:
                fix, default = wrong[kw_name]
                self.emit(wrong_id, kw, kw=kw_name, fix=fix, default=default)
            elif accepted is not None and kw_name not in accepted:
                self.unknown_keyword(kw, kw_name, op, accepted)

        ctx = self.info.ctx_of(call)
        is_absorb = self.mla_kind(call, named) == "absorb"
        for sc in self.call_cases(call, ctx, star):
            # report where the value is written (it may be set lines above the call)
            anchor_sparse = sc.sparse_origin or call
            anchor_mask = sc.mask_origin or call
            fired = self.fa_fired.setdefault(id(call), set())
            if sc.certain and sc.sparse == 0:
                if sc.ctx.phase == PREFILL and sc.no_mask and sc.mask is not OPAQUE:
                    self.emit("KV201", anchor_sparse, mode=0)
                    fired.add("KV201")
                elif sc.ctx.sliding is True:
                    self.emit("KV202", anchor_sparse)
                    fired.add("KV202")
            if sc.certain and is_absorb and sc.ctx.phase == DECODE and sc.sparse == 3 and \
                    not self.info.in_mtp_branch(call):
                self.emit("KV203", anchor_sparse)
                fired.add("KV203")
            if sc.mask in (MISSING, OPAQUE) or is_none(sc.mask):
                continue
            dtype = self.masks.dtype(sc.mask, sc.mask_at, sc.ctx)
            if dtype == "float":
                self.emit("KV204", anchor_mask, dtype="a floating-point tensor")
            if sc.certain and sc.sparse in COMPRESSED_MASK_MODES:
                shape = self.masks.shape(sc.mask, sc.mask_at, sc.ctx)
                if shape is not None and shape not in COMPRESSED_MASK_SHAPES:
                    self.emit("KV205", anchor_mask, shape=shape, mode=sc.sparse)

        if "block_table" in named:
            self.dict_whole(named["block_table"].value, call, ctx, "block_table", op)
        if is_absorb:
            self.mla_kv_heads(call, named, star, ctx)

    def checked_keywords(self, call: ast.Call, op: str) -> tuple[dict[str, ast.keyword], bool]:
        """The call's keywords (and whether a ``**`` stays opaque), after KV103 on every name the op's schema
        in the judged release lacks."""
        named, star = call_keywords(call)
        accepted = ops.accepted_keywords(op, self.release.release)
        if accepted is not None:
            for kw_name, kw in named.items():
                if kw_name not in accepted:
                    self.unknown_keyword(kw, kw_name, op, accepted)
        return named, star

    def dsa_call(self, call: ast.Call, op: str) -> None:
        """KV103 on the keywords, KV206 (not causal), KV503 (absorb over two tensors), KV812 (with a manifest:
        the indexer's width), and a whole block_table dict (KV301)."""
        named, star = self.checked_keywords(call, op)
        ctx = self.info.ctx_of(call)
        for v in self.arg_variants(call, "sparse_mode", ctx, star):
            mode = self._certain_int(v)
            if mode is not None and mode != 3:
                self.emit("KV206", v.origin or call, op=op, mode=mode)
                break
        if op == ops.SPARSE_FA:
            self._absorb_key_value(call, named, star, ctx)
        dsa = getattr(self.manifest, "dsa", None) if self.manifest is not None else None
        if op == ops.INDEXER and dsa is not None:
            for v in self.arg_variants(call, "sparse_count", ctx, star):
                count = self._certain_int(v)
                if count is not None and count != dsa.index_topk:
                    self.emit("KV812", v.origin or call, value=count, expected=dsa.index_topk)
                    break
        if "block_table" in named:
            self.dict_whole(named["block_table"].value, call, ctx, "block_table", op)

    def _certain_int(self, v: Variant) -> int | None:
        if not v.certain or v.node is MISSING or v.node is OPAQUE:
            return None
        value = as_int(v.node)
        return value if value is not None else self.resolver.number(v.node, v.at, v.ctx)

    def _absorb_key_value(self, call: ast.Call, named, star: bool, ctx: Ctx) -> None:
        if not any(self._certain_int(v) == 2 for v in self.arg_variants(call, "attention_mode", ctx, star)):
            return

        def resolved(name: str, pos: int):
            node = named[name].value if name in named else (call.args[pos] if len(call.args) > pos else None)
            if node is None:
                return None
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                # a `**kwargs` dict's entry: the expression written into the dict (not resolved further: two
                # caches both start as `torch.Tensor([])`)
                written = dict_keys(self.info, node.value, call) or {}
                key_text = as_str(node.slice)
                if key_text in written:
                    node = written[key_text]
                    node = node.value if isinstance(node, ast.Assign) else node
            return [ast.unparse(node)]

        key, value = resolved("key", 1), resolved("value", 2)
        if key and value and not set(key) & set(value):
            self.emit("KV503", named["value"] if "value" in named else call, key=key[0], value=value[0])

    def unknown_keyword(self, kw: ast.keyword, name: str, op: str, accepted: frozenset[str]) -> None:
        """KV103, naming the release judged, why that one, and the releases that do have the keyword."""
        others = ops.releases_accepting(op, name)
        fix = (f"the keyword exists in torch_npu {', '.join(others)}: install that release (and say so in the "
               "folder's README) or drop the keyword" if others else _closest_hint(name, accepted))
        self.emit("KV103", kw, kw=name, op=op, release=self.release.release, why=self.release.why, fix=fix)

    def mla_kv_heads(self, call: ast.Call, named, star: bool, ctx: Ctx) -> None:
        if "num_key_value_heads" not in named:
            if not star:
                self.emit("KV502", call, what="omits num_key_value_heads (default 0 means one KV head per "
                                              "query head)")
            return
        node = named["num_key_value_heads"].value
        for v in self.resolver.certain_variants(node, call, ctx):
            value = as_int(v.node)
            if value is None:
                value = self.resolver.number(v.node, v.at, v.ctx)
            if isinstance(value, int) and value != 1:
                at = v.origin if v.via is not None else node  # a helper's value: where the caller writes it
                self.emit("KV502", at, what=f"passes num_key_value_heads={value}")
                return
            term = _terminal(v.node) or ""
            # a head count read from the model config (directly or via self.<attr> = config.<...>)
            if value is None and _has_config_root(v.node) and \
                    ("num_key_value_heads" in term or "num_kv_heads" in term or term == "num_attention_heads"):
                self.emit("KV502", node, what=f"passes num_key_value_heads=`{ast.unparse(node)}`")
                return

    # ------------------------------------------------------------ writers

    def writer_call(self, call: ast.Call, op: str) -> None:
        named, star = self.checked_keywords(call, op)
        ctx = self.info.ctx_of(call)
        if op in ops.WRITER_INDEX_ARG:
            kw_name, pos = ops.WRITER_INDEX_ARG[op]
            index = named[kw_name].value if kw_name in named else (call.args[pos] if len(call.args) > pos else None)
            if index is not None:
                self.dict_whole(index, call, ctx, "slot_mapping", op)
        if op in ops.RMSNORM_OPS:
            self.epsilon(call, named, star, ctx, op)

    def epsilon(self, call: ast.Call, named, star: bool, ctx: Ctx, op: str) -> None:
        if "epsilon" not in named:
            if not star:
                self.emit("KV601", call, op=op, what="omits epsilon, so the op default 1e-5 is used")
            return
        node = named["epsilon"].value
        for v in self.resolver.certain_variants(node, call, ctx):
            value = as_number(v.node)
            if value is not None:
                at = v.origin if v.via is not None else node  # a helper's value: where the caller writes it
                self.emit("KV601", at, op=op, what=f"passes a literal epsilon ({value!r})")
                return

    # ------------------------------------------------------------ index dicts

    def dict_whole(self, node: ast.AST, call: ast.Call, ctx: Ctx, field: str, op: str) -> None:
        found = self._find_dict(node, call, ctx, field, 0)
        if found is not None:
            site, base = found
            self.emit(_DICT_FIELDS[field], site, expr=ast.unparse(base), op=op)

    def _find_dict(self, node: ast.AST, at: ast.AST, ctx: Ctx, field: str, depth: int):
        """(where the dict is passed on, the dict expression) if ``node`` is the whole index dict.

        Follows local names and ``self`` attributes, and a helper's parameter back to the
        helper's call sites in the same class or module (``self.paged_attention(q, block_table)``).
        """
        if depth > 3:
            return None
        base = strip_methods(node)
        if self._is_dict_source(base, at, field):
            return node, base
        if not isinstance(base, (ast.Name, ast.Attribute)) and dict_item_key(base) is None:
            return None
        for v in self.resolver.certain_variants(base, at, ctx):
            if v.node is base:
                continue
            inner = strip_methods(v.node)
            if v.via is not None:
                if isinstance(base, ast.Name) and self.info.is_parameter(self.info.function_of(at), base.id):
                    continue  # the helper's own parameter: followed below to the argument at each call site
                if self._is_dict_source(inner, v.at, field):
                    return v.via, inner  # passed in through a helper call (a **kwargs entry): report that call
                continue
            if self._is_dict_source(inner, v.at, field):
                # a `**kwargs` dict entry is reported where it is written, a local name at its use
                return (inner if dict_item_key(base) is not None else node), inner
            if isinstance(inner, ast.Name):
                found = self._dict_through_callers(inner, v.at, field, depth)
                if found is not None:
                    return found
        if isinstance(base, ast.Name):
            return self._dict_through_callers(base, at, field, depth)
        return None

    def _dict_through_callers(self, name: ast.Name, at: ast.AST, field: str, depth: int):
        func = self.info.function_of(at)
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or self.info.parameter(func, name.id) is None:
            return None
        for call, arg in self.info.call_site_args(func, name.id):
            found = self._find_dict(arg, call, self.info.ctx_of(call), field, depth + 1)
            if found is not None:
                return found
        return None

    def _is_dict_source(self, node: ast.AST, at: ast.AST, field: str) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == field and self.framework:
            # the framework's ForwardMetaData (forward_metadata, get_forward_metadata(), metadata)
            owner = _ident_text(node.value).lower()
            return "forward_meta" in owner or owner.rsplit(".", 1)[-1] in ("metadata", "fwd_metadata", "fwd_meta")
        if isinstance(node, ast.Name):
            func = self.info.function_of(at)
            param = self.info.parameter(func, node.id)
            if param is None:
                return False
            if param.annotation is not None and re.search(r"\b(dict|Dict|Mapping)\b", ast.unparse(param.annotation)):
                return True
            doc = ast.get_docstring(func) if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if doc:
                for line in doc.splitlines():
                    if re.search(rf"\b{re.escape(node.id)}\b", line) and re.search(r"\bdict\b", line, re.IGNORECASE) \
                            and not re.search(r"\bnot\b[^.]*\bdict\b", line, re.IGNORECASE):
                        return True
        return False

    # ------------------------------------------------------------ kv_len

    def _kv_len_scope(self, node: ast.AST) -> str | None:
        """``Class.method`` when ``node`` is in model code that must only read kv_len, else None.

        Model code: a forward (``forward``, ``forward_*``, ``_forward*``) or an attention/cache
        helper of a model component (an ``nn.Module``-like class, a mixin, or a class named like
        an attention / layer / model), or a free attention helper. The runner, which owns kv_len,
        is never model code.
        """
        names = self.info.function_names(node)
        if not names or self._is_runner_code(node):
            return None
        inner = names[0]
        low = inner.lower()
        forward_like = low == "forward" or low.startswith(("forward_", "_forward"))
        helper_like = "attn" in low or "attention" in low or "cache" in low
        cls = self.info.class_of(node)
        if cls is None:
            return inner if (helper_like or forward_like) else None
        if not _is_model_class(cls):
            return None
        return f"{cls.name}.{inner}" if (forward_like or helper_like) else None

    @staticmethod
    def _is_kv_len(node: ast.AST) -> bool:
        return _terminal(node) == "kv_len" and isinstance(node, (ast.Name, ast.Attribute))

    def _kv_len_assign(self, node: ast.AST) -> None:
        if isinstance(node, ast.AugAssign):
            if self._is_kv_len(node.target) and isinstance(node.op, (ast.Add, ast.Sub)):
                where = self._kv_len_scope(node)
                if where:
                    self.emit("KV401", node, expr=ast.unparse(node), where=where)
            return
        if len(node.targets) != 1 or not self._is_kv_len(node.targets[0]):
            return
        target = ast.unparse(node.targets[0])
        value = node.value
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub)) and \
                target in (ast.unparse(value.left), ast.unparse(value.right)):
            where = self._kv_len_scope(node)
            if where:
                self.emit("KV401", node, expr=ast.unparse(node), where=where)

    def kv_len_inplace(self, call: ast.Call, receiver: ast.AST) -> None:
        if self._is_kv_len(receiver):
            where = self._kv_len_scope(call)
            if where:
                self.emit("KV401", call, expr=ast.unparse(call), where=where)

    # ------------------------------------------------------------ cache entries

    def cache_entry(self, call: ast.Call) -> None:
        named, _ = call_keywords(call)
        node = named["num_head"].value if "num_head" in named else (call.args[3] if len(call.args) > 3 else None)
        if node is None:
            return
        ctx = self.info.ctx_of(call)
        if self._kv_heads_replicated(call, node):
            return
        for v in self.resolver.certain_variants(node, call, ctx):
            target = v.node
            if isinstance(target, ast.Attribute) and target.attr in _RAW_KV_HEAD_NAMES and _has_config_root(target):
                self.emit("KV501", node, expr=ast.unparse(node))
                return
            if isinstance(target, ast.Call) and _terminal(target.func) == "getattr" and len(target.args) >= 2 \
                    and isinstance(target.args[1], ast.Constant) and target.args[1].value in _RAW_KV_HEAD_NAMES:
                self.emit("KV501", node, expr=ast.unparse(node))
                return

    def _kv_heads_replicated(self, call: ast.Call, num_head: ast.AST) -> bool:
        """The class projects K with a plain ``nn.Linear`` over the same head count: not tensor-parallel.

        Attention whose K projection is an ordinary ``Linear(hidden, <heads> * head_dim)`` computes every
        KV head on every rank, so a cache entry with all KV heads matches what the layer writes (Gemma-4
        upstream). A sharded projection (``ColumnParallelLinear``, or a Linear sized by a per-rank count)
        keeps the finding.
        """
        cls = self.info.class_of(call)
        if cls is None:
            return False
        head = _terminal(num_head)
        if not head:
            return False
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Call) and _terminal(node.func) == "Linear"):
                continue
            named = {kw.arg: kw.value for kw in node.keywords if kw.arg}
            out = named.get("out_features", node.args[1] if len(node.args) > 1 else None)
            if out is not None and any(_terminal(n) == head for n in ast.walk(out)
                                       if isinstance(n, (ast.Name, ast.Attribute))):
                return True
        return False

    # ------------------------------------------------------------ packed hidden states

    def hidden_view(self, call: ast.Call) -> None:
        if self.packed and self.layout.judge(call):
            self.emit("KV701", call, expr=ast.unparse(call))


_MODEL_CLASS_WORDS = re.compile(r"attention|attn|layer|model|decoder|block|mla|mlp|moe|mixin|module", re.IGNORECASE)


def _is_model_class(cls: ast.ClassDef) -> bool:
    """A model component: nn.Module-like base (``*Module``, ``*Model``, ``*Layer``, ``*Mixin``) or named so."""
    bases = [ast.unparse(base) for base in cls.bases]
    return bool(_MODEL_CLASS_WORDS.search(cls.name) or any(_MODEL_CLASS_WORDS.search(b) for b in bases))


def _closest_hint(name: str, accepted: frozenset[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(accepted), n=1)
    return f"did you mean `{close[0]}=`?" if close else "remove it or use a documented argument of the op"


def format_fields(rule_id: str, fields: dict) -> tuple[str, str]:
    rule = RULES[rule_id]
    return rule.message.format(**fields), rule.hint.format(**fields)
