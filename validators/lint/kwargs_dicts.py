"""Open ``op(q, k, v, **fa_kwargs)``: the keywords a local dict passes into a call.

Real code often builds the FA arguments as a dict (``{"block_table": ..., "sparse_mode": 3}``,
``dict(block_table=...)``, then ``kw["sparse_mode"] = 0`` per branch). ``expand_star_kwargs``
rewrites such a call's ``**name`` into one keyword per key the dict holds, each valued
``name["key"]``, which the resolver follows per branch to the literal entry or the write (findings
point there). A dict whose keys the linter cannot list (``**other`` inside it, a computed key,
``.update(...)``/``.pop(...)``) is left as ``**name``: unknown, never reported.
"""

from __future__ import annotations

import ast

from model_infer_kvcache.validators.lint.scope import ModuleInfo
from model_infer_kvcache.validators.lint.values import _precedes, as_str, dict_literal_items


def dict_keys(info: ModuleInfo, name: ast.Name, call: ast.Call) -> dict[str, ast.AST] | None:
    """Every key ``name`` may hold at ``call`` and where it is written (None when they cannot all be listed)."""
    func = info.function_of(call)
    if func is None:
        return None
    use_stmt = info.statement_of(call)
    defs = [d for d in info.local_defs(func).get(name.id, []) if _precedes(d, use_stmt, info)]
    if not defs or not all(isinstance(d, ast.Assign) and len(d.targets) == 1 for d in defs):
        return None
    keys: dict[str, ast.AST] = {}  # key -> where it is first written (findings on the keyword point there)
    for d in defs:
        items = dict_literal_items(d.value)
        if items is None:
            return None
        for k, value in items:
            keys.setdefault(k, value)
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == name.id and \
                node.func.attr in ("update", "pop", "setdefault", "clear", "popitem"):
            return None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript) \
                and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == name.id \
                and _precedes(node, use_stmt, info):
            key = as_str(node.targets[0].slice)
            if key is None:
                return None
            keys.setdefault(key, node.targets[0])
    return keys


def call_keywords(call: ast.Call) -> tuple[dict[str, ast.keyword], bool]:
    """(keyword name -> keyword, whether a ``**`` the linter could not open remains)."""
    named = {kw.arg: kw for kw in call.keywords if kw.arg is not None}
    return named, any(kw.arg is None for kw in call.keywords)


def expand_star_kwargs(info: ModuleInfo, call: ast.Call) -> None:
    """Replace each ``**name`` of ``call`` whose keys are all visible by ``key=name["key"]`` keywords."""
    if not any(kw.arg is None for kw in call.keywords):
        return
    keywords: list[ast.keyword] = []
    for kw in call.keywords:
        keys = dict_keys(info, kw.value, call) if kw.arg is None and isinstance(kw.value, ast.Name) else None
        if keys is None:
            keywords.append(kw)
            continue
        for key, written in keys.items():
            item = ast.Subscript(value=ast.Name(id=kw.value.id, ctx=ast.Load()), slice=ast.Constant(value=key),
                                 ctx=ast.Load())
            synth = ast.keyword(arg=key, value=item)
            for node in (synth, item, item.value, item.slice):
                ast.copy_location(node, written)
            info.parents[synth], info.parents[item] = call, synth
            info.parents[item.value] = info.parents[item.slice] = item
            keywords.append(synth)
    call.keywords = keywords
