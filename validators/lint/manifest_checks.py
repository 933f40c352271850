"""Rules that compare the code with a SelectionManifest (``kvcache lint --manifest M``): KV8xx."""

from __future__ import annotations

import ast
import re

from model_infer_kvcache.analyzer.config_loader import yarn_mscale
from model_infer_kvcache.analyzer.device_questions import QUESTIONS
from model_infer_kvcache.analyzer.framework_checkout import render_api
from model_infer_kvcache.analyzer.operators import fa_facts, schemas
from model_infer_kvcache.analyzer.rules import decide_window_tokens
from model_infer_kvcache.validators.lint import ops
from model_infer_kvcache.validators.lint.kwargs_dicts import call_keywords
from model_infer_kvcache.validators.lint.scope import DECODE, PREFILL, Ctx, _ident_text, is_self_attr
from model_infer_kvcache.validators.lint.values import MAX_DEPTH, as_int, as_str

_YARN_WORDS = re.compile(r"mscale|yarn|attention_factor|attn_factor|attention_scaling", re.IGNORECASE)
_NUMERIC_FUNCS = {"sqrt", "pow", "float", "int", "max", "min", "getattr", "log", "exp"}
_WINDOW_NAMES = ("sliding_window", "window_size", "window")


class ManifestChecks:
    def __init__(self, checker) -> None:
        self.c = checker
        self.m = checker.manifest
        self.resolver = checker.resolver
        self.info = checker.info

    def run(self) -> None:
        for call, op in self.c.fa_calls:
            self.fa_call(call, op)
        m = self.m
        # The model-side contract the code must follow (a G3 framework takes G2's CacheEntry/ModelCacheInfo keywords).
        gen = render_api(m.framework_api) if m.deploy_mode.value == "framework" else None
        for call in self.c.entry_calls:
            self.block_size_value(call)
            if gen:
                self.entry_generation(call, gen)
        for call in self.c.cache_info_calls:
            self.block_size_value(call)
            if gen:
                self.cache_info_generation(call, gen)
        if m.mixed_attn_types:
            self.constant_attn_type()

    # ------------------------------------------------------------ FA calls

    def fa_call(self, call: ast.Call, op: str) -> None:
        m = self.m
        named, star = call_keywords(call)
        expected_op = fa_facts.FA_OPS[m.fa.version]
        if op != expected_op:
            self.c.emit("KV803", call, op=op, expected=m.fa.version, fix=f"torch_npu.{expected_op}")
        ctx = self.info.ctx_of(call)
        # the manifest's layout is the absorb path's; an MLA non-absorb prefill has its own
        if "input_layout" in named and self.c.mla_kind(call, named) != "expanded":
            node = named["input_layout"].value
            for v in self.resolver.certain_variants(node, call, ctx):
                value = as_str(v.node)
                if value is not None and value != m.fa.input_layout:
                    self.c.emit("KV804", _origin(v, node), value=value, expected=m.fa.input_layout)
                    break
        self.scale(call, named, star, ctx)
        self.block_size_value(call)
        self.sparse_and_window(call, named, star, ctx)
        self.mtp_verify_case(call, ctx, star)

    def scale(self, call: ast.Call, named, star: bool, ctx: Ctx) -> None:
        m = self.m
        expected = m.fa.softmax_scale
        # Either version's spelling (v2 first): a wrong-version name is KV101/102's, its value still checked here.
        scale_names = [kw.scale for kw in reversed(fa_facts.FA_KEYWORDS.values())]
        key = next((name for name in scale_names if name in named), None)
        if key is None:
            if not star:
                default = schemas.default_text(fa_facts.FA_OPS[m.fa.version], fa_facts.FA_KEYWORDS[m.fa.version].scale)
                self.c.emit("KV802", call, value=f"not passed (op default {default})", expected=expected)
            return
        node = named[key].value
        rope = m.model.rope
        needs_yarn = rope.rope_type == "yarn" and yarn_mscale(rope.factor, rope.mscale_all_dim) != 1.0
        for v in self.resolver.certain_variants(node, call, ctx):
            number = self.resolver.number(v.node, v.at, v.ctx)
            if number is not None:
                if abs(number - expected) > 1e-6 * abs(expected) + 1e-12:
                    self.c.emit("KV802", _origin(v, node), value=f"{number:.6g}", expected=expected)
                return
            if needs_yarn:
                idents: set[str] = set()
                complete = self._closure(v.node, v.at, v.ctx, idents, 0)
                if complete and not any(_YARN_WORDS.search(i) for i in idents):
                    self.c.emit("KV801", _origin(v, node), expr=ast.unparse(v.node), expected=expected)
                    return

    def _closure(self, node: ast.AST, at: ast.AST, ctx: Ctx, idents: set[str], depth: int) -> bool:
        """Collect identifiers the value is built from; False when part of it cannot be seen."""
        if depth > MAX_DEPTH:
            return False
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                idents.add(node.value)
            return True
        if isinstance(node, ast.Name) or is_self_attr(node):
            idents.add(node.id if isinstance(node, ast.Name) else node.attr)
            found = self.resolver.variants(node, at, ctx)
            complete = True
            for v in found:
                if v.node is node:
                    # unresolved: a config object is a fact source; anything else is unknown
                    complete &= isinstance(node, ast.Name) and "config" in node.id.lower()
                else:
                    complete &= self._closure(v.node, v.at, v.ctx, idents, depth + 1)
            return complete
        if isinstance(node, ast.Attribute):
            idents.add(node.attr)
            root = _ident_text(node).split(".")
            return any("config" in part.lower() for part in root[:-1])
        if isinstance(node, ast.BinOp):
            return self._closure(node.left, at, ctx, idents, depth + 1) & \
                self._closure(node.right, at, ctx, idents, depth + 1)
        if isinstance(node, ast.UnaryOp):
            return self._closure(node.operand, at, ctx, idents, depth + 1)
        if isinstance(node, ast.IfExp):
            parts = [self._closure(n, at, ctx, idents, depth + 1) for n in (node.test, node.body, node.orelse)]
            return all(parts)
        if isinstance(node, ast.Subscript):
            return self._closure(node.value, at, ctx, idents, depth + 1) & \
                self._closure(node.slice, at, ctx, idents, depth + 1)
        if isinstance(node, ast.Call):
            name = ops.terminal_name(node.func) or ""
            idents.add(name)
            parts = [self._closure(a, at, ctx, idents, depth + 1) for a in node.args]
            return name in _NUMERIC_FUNCS and all(parts)
        return False

    def sparse_and_window(self, call: ast.Call, named, star: bool, ctx: Ctx) -> None:
        m = self.m
        sliding_layers = [layer for layer in m.layers if layer.is_sliding]
        already = bool(self.c.fa_fired.get(id(call)))
        mtp = self.info.in_mtp_branch(call)
        for sc in self.c.call_cases(call, ctx, star):
            if not sc.certain:
                continue
            layers = m.attention_layers
            if sc.ctx.sliding is True:
                layers = sliding_layers
            elif sc.ctx.sliding is False:
                layers = [layer for layer in m.attention_layers if not layer.is_sliding]
            anchor = sc.sparse_origin or call
            if sc.sparse is not None and layers and not already and not (mtp and sc.ctx.phase != PREFILL):
                phases = [sc.ctx.phase] if sc.ctx.phase else [PREFILL, DECODE]
                allowed = sorted({getattr(layer.sparse_mode, p) for layer in layers for p in phases})
                if sc.sparse not in allowed:
                    self.c.emit("KV805", anchor, path=_path_words(sc.ctx), value=sc.sparse,
                                expected=" or ".join(map(str, allowed)))
            if sliding_layers and (sc.ctx.sliding is True or (sc.sparse == 4 and sc.ctx.sliding is not False)):
                self.pre_tokens(call, named, star, sc.ctx, sliding_layers)

    def mtp_verify_case(self, call: ast.Call, ctx: Ctx, star: bool) -> None:
        """KV811: with MTP layers, a decode FA call of full-attention layers needs a q_len > 1 case.

        The call is fine when its decode sparse_mode can be the manifest's MTP one (a branch on the
        query length, or that mode for every decode step), or when it sits in a branch that tests
        the query length / MTP itself (its sibling call handles the other case).
        """
        m = self.m
        if m.mtp is None or m.kv_mode.value != "paged" or self.info.in_mtp_branch(call):
            return
        decode = [sc for sc in self.c.call_cases(call, ctx, star)
                  if sc.ctx.phase == DECODE and sc.ctx.sliding is not True and sc.sparse is not None]
        if any(sc.sparse == m.mtp.decode_sparse_mode for sc in decode):
            return
        wrong = next((sc for sc in decode if sc.certain), None)
        if wrong is not None and any(not layer.is_sliding for layer in m.layers):
            self.c.emit("KV811", wrong.sparse_origin or call, layers=m.mtp.num_layers, value=wrong.sparse,
                        expected=m.mtp.decode_sparse_mode)

    def pre_tokens(self, call: ast.Call, named, star: bool, ctx: Ctx, sliding_layers) -> None:
        expected = sorted({layer.pre_tokens for layer in sliding_layers})
        windows = {layer.sliding_window for layer in sliding_layers}
        window = windows.pop() if len(windows) == 1 else None
        if "pre_tokens" not in named:
            if not star:
                self.c.emit("KV806", call, value=f"{fa_facts.INT32_MAX} (not passed)",
                            expected=" or ".join(map(str, expected)))
            return
        node = named["pre_tokens"].value
        for v in self.resolver.certain_variants(node, call, ctx):
            value = self._window_number(v.node, v.at, v.ctx, window, 0)
            if isinstance(value, int) and value not in expected:
                self.c.emit("KV806", _origin(v, node), value=value,
                            expected=" or ".join(map(str, expected)) + self._other_reading(value, sliding_layers))
                return

    def _other_reading(self, value: int, sliding_layers) -> str:
        """Where the manifest's pre_tokens rest on an unmeasured window_pre_tokens reading and the code's value is
        the other reading's: say so. The code may be right (upstream gpt_oss and gemma_4 pass W, correct under
        'inclusive'); only the device settles which."""
        dep = next((d for d in self.m.device_dependencies if d.question == "window_pre_tokens"), None)
        if dep is None or dep.status != "assumed":
            return ""
        for reading in QUESTIONS["window_pre_tokens"].alternatives(dep.assumed):
            if value in {decide_window_tokens(layer.sliding_window, reading)[0] for layer in sliding_layers}:
                return (f" under the assumed window_pre_tokens reading '{dep.assumed}' ({value} is right under "
                        f"'{reading}', which no NPU has settled: run `kvcache probe`, or re-analyze with "
                        f"--window-reading {reading} if the code's reading is the device's)")
        return ""

    def _window_number(self, node, at, ctx, window, depth):
        """Integer value with the manifest's window substituted for ``*.sliding_window`` references."""
        if depth > MAX_DEPTH:
            return None
        term = ops.terminal_name(node)
        if term is not None and window is not None and any(w == term for w in _WINDOW_NAMES):
            return window
        value = as_int(node)
        if value is not None:
            return value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left = self._window_number(node.left, at, ctx, window, depth + 1)
            right = self._window_number(node.right, at, ctx, window, depth + 1)
            if isinstance(left, int) and isinstance(right, int):
                return left + right if isinstance(node.op, ast.Add) else left - right
            return None
        if isinstance(node, (ast.Name, ast.Attribute)):
            v = self.resolver.single(node, at, ctx)
            if v is not None and v.node is not node:
                return self._window_number(v.node, v.at, v.ctx, window, depth + 1)
        return None

    # ------------------------------------------------------------ cache declarations

    def block_size_value(self, call: ast.Call) -> None:
        named, _ = call_keywords(call)
        if "block_size" not in named:
            return
        node = named["block_size"].value
        ctx = self.info.ctx_of(call)
        for v in self.resolver.certain_variants(node, call, ctx):
            value = self.resolver.number(v.node, v.at, v.ctx)
            if isinstance(value, int) and value != self.m.block_size:
                self.c.emit("KV807", _origin(v, node), value=value, expected=self.m.block_size)
                return

    def entry_generation(self, call: ast.Call, gen: str) -> None:
        named, star = call_keywords(call)
        has = "block_size" in named or len(call.args) > 6
        if gen in ("G0", "G1") and "block_size" in named:
            self.c.emit("KV808", named["block_size"], gen=gen,
                        what="CacheEntry has no block_size field before G2 (TypeError at init)",
                        fix="move block_size to ModelCacheInfo(block_size=...) in get_cache_info()")
        if gen == "G2" and not has and not star:
            needs = named.get("needs_block")
            if needs is not None and isinstance(needs.value, ast.Constant) and needs.value.value is False:
                return
            self.c.emit("KV808", call, gen=gen,
                        what="CacheEntry with needs_block has no block_size (required per entry in G2)",
                        fix="pass block_size=self.block_size on every paged CacheEntry")

    def cache_info_generation(self, call: ast.Call, gen: str) -> None:
        named, star = call_keywords(call)
        m = self.m
        if gen in ("G0", "G1") and "block_size" not in named and len(call.args) < 2 and not star:
            self.c.emit("KV808", call, gen=gen,
                        what="ModelCacheInfo has no block_size (required in G0/G1: init fails)",
                        fix="pass block_size=self.block_size to ModelCacheInfo in get_cache_info()")
        if gen == "G2" and "block_size" in named:
            self.c.emit("KV808", named["block_size"], gen=gen,
                        what="ModelCacheInfo has no block_size field in G2 (TypeError at init)",
                        fix="pass block_size on each CacheEntry instead")
        flag = named.get("is_mla_backend")
        if gen == "G0":
            if flag is not None:
                self.c.emit("KV809", flag, gen=gen, what="ModelCacheInfo has no is_mla_backend field in G0",
                            fix="drop is_mla_backend (G0 has no MLA replication flag)")
            return
        positional = len(call.args) > (3 if gen == "G1" else 2)
        value = flag.value if flag is not None else None
        is_false = isinstance(value, ast.Constant) and value.value is False
        is_true = isinstance(value, ast.Constant) and value.value is True
        # the framework's is_mla_backend: "latent KV replicated across TP ranks" (ModelCacheInfo), the manifest's
        # parallel decision of the same name
        mla_backend = m.parallel.latent_replicated
        if mla_backend and (is_false or (flag is None and not positional and not star)):
            self.c.emit("KV809", flag if flag is not None else call, gen=gen,
                        what="MLA model's ModelCacheInfo does not set is_mla_backend=True (latent cache "
                             "sized as if split across attention TP)",
                        fix="pass is_mla_backend=True")
        elif not mla_backend and is_true:
            self.c.emit("KV809", flag, gen=gen, what="is_mla_backend=True on a model that is not MLA",
                        fix="drop is_mla_backend (default False)")

    def constant_attn_type(self) -> None:
        sites: list[tuple[ast.AST, object]] = []
        for node in self.c.info.nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if is_self_attr(target) and target.attr == "attn_type":
                        sites.append((node.value, _const(node.value)))
        for call in self.c.entry_calls:
            named, _ = call_keywords(call)
            value = named["attn_type"].value if "attn_type" in named else (call.args[1] if len(call.args) > 1 else None)
            if value is None or (is_self_attr(value) and value.attr == "attn_type"):
                continue
            sites.append((value, _const(value)))
        if not sites:
            return
        values = {value for _, value in sites}
        if len(values) == 1 and None not in values:
            kinds = sorted({layer.attn_type for layer in self.m.layers})
            self.c.emit("KV810", sites[0][0], value=values.pop(), expected=" and ".join(kinds))


def _origin(variant, fallback: ast.AST) -> ast.AST:
    """Where a value is written (possibly lines above its use): the place to fix it."""
    return variant.origin or fallback


def _const(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _path_words(ctx: Ctx) -> str:
    words = []
    if ctx.sliding is True:
        words.append("sliding-window")
    elif ctx.sliding is False:
        words.append("full-attention")
    words.append(ctx.phase or "prefill/decode")
    return " ".join(words)
