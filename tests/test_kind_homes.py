"""Kind branches live in the kinds' homes (issue 44): a ratchet over the source files that still branch on a kind.

A *kind branch* is code that asks which cache kind a manifest or a layer holds instead of asking the kind: an
attribute read of a kind section (``.mla``, ``.dsa``, ``.linear_attention``), a comparison with a layer's
``attn_type`` / ``layer_kind``, or the framework's kind strings spelled out ("FullAttention", "SlidingWindow",
"Mamba"). The homes are ``analyzer/kv_cache_spec.py`` (the specs and their block math), ``analyzer/kinds/`` (a
kind's analyzer side, and the one reading of which kinds a manifest holds), ``implementer/kinds/`` (each kind's
render side) and ``validators/kinds/`` (what is checked about each kind). ``OUTSIDE`` lists the files that still branch elsewhere, as measured: a new file that
branches fails, and a listed file that no longer does must leave the list, so the count only goes down.
"""

from __future__ import annotations

import ast

from shared_dirs import ROOT

# manifest sections and the attention-format flags read from them (a layer's is_sliding / is_state ask its spec,
# the approved way: ARCHITECTURE.md, "Adding a cache kind")
SECTIONS = {"mla", "dsa", "linear_attention", "compressed", "is_mla", "is_dsa"}
KIND_FIELDS = {"attn_type", "layer_kind"}
KIND_STRINGS = {"FullAttention", "SlidingWindow", "Mamba"}
KIND_CONSTANTS = {"FULL_ATTENTION", "SLIDING_WINDOW", "MAMBA"}  # analyzer/kv_cache_spec.py's names for them
HOMES = ("analyzer/kv_cache_spec.py", "analyzer/kinds/", "implementer/kinds/", "validators/kinds/")
PARTS = ("analyzer", "implementer", "validators")

# Measured when the render side moved into implementer/kinds/: 24 files (25 with template_context.py before it); 7
# once the validators' kind facts (and the tiny model's per-kind shapes) moved into validators/kinds/ and the harness
# and the Mamba checks asked the spec (holds_state, is_windowed, LayerPlan.is_recurrent) instead of spelling the
# framework's strings.
# 2 once the analyzer side of every attention format moved into analyzer/kinds/ (gqa, mla, dsa, compressed: the
# rules and the plan builder ask analyzer.kinds.formats.format_of(facts); the decisions table, the manifest's
# invariant and SKILL.md's model-kinds table ask the manifest's format): config_loader's ModelFacts.is_mla (the
# facts reader) and the checkout run's checks (DSA's sparse calls and indexer, judged by checkout_run/dsa_checks)
# remain.
OUTSIDE = frozenset({"analyzer/config_loader.py", "validators/checkout_run/checks.py"})


def _conditions(tree: ast.AST):
    """The expressions code decides on: if / while / assert / conditional-expression / comprehension tests, and
    every boolean operation and comparison."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, (ast.BoolOp, ast.Compare)):
            yield node


def kind_branches(source: str) -> list[int]:
    """Line numbers of the kind branches in ``source`` (module docstring above): a decision on a kind section
    (reading one for its data is not a branch), a kind field compared with a kind, a kind string spelled out."""
    tree = ast.parse(source)
    lines = []
    for test in _conditions(tree):
        for node in ast.walk(test):
            if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
                lines.append(node.lineno)
            elif isinstance(node, ast.Compare) and _names_a_kind(node):
                lines.append(node.lineno)
    lines += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in KIND_STRINGS]
    return sorted(set(lines))


def _is_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Name, ast.Attribute)):
        return (node.id if isinstance(node, ast.Name) else node.attr) in KIND_CONSTANTS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_kind(e) for e in node.elts)
    return False


def _names_a_kind(node: ast.Compare) -> bool:
    """A layer's attn_type / layer_kind compared with one kind (a string or a spec constant), not with another
    field (``group_key != attn_type`` asks no kind)."""
    sides = (node.left, *node.comparators)
    fields = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in KIND_FIELDS]
    return bool(fields) and any(_is_kind(s) for s in sides if s not in fields)


def _outside_homes() -> dict[str, list[int]]:
    out = {}
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(HOMES):
                continue
            found = kind_branches(path.read_text(encoding="utf-8"))
            if found:
                out[rel] = found
    return out


def test_no_new_file_branches_on_a_kind_and_the_list_only_shrinks():
    found = _outside_homes()
    new = {f: lines[:5] for f, lines in found.items() if f not in OUTSIDE}
    assert not new, f"kind branches outside the kinds' homes (ask the kind instead, {HOMES}): {new}"
    gone = sorted(OUTSIDE - set(found))
    assert not gone, f"no longer branch on a kind: remove them from OUTSIDE: {gone}"


def test_the_validators_ask_their_kinds():
    """The checks that differ by kind (rendered constants, attention calls, verify steps, multi-rank sharding) take
    them from validators/kinds, not from branches on the manifest's sections."""
    found = _outside_homes()
    for rel in ("validators/pipeline/render_check.py", "validators/pipeline/fa_args.py",
                "validators/pipeline/spec_decode.py", "validators/pipeline/multi_rank.py",
                "validators/pipeline/tiny_model.py"):
        assert rel not in found, (rel, found.get(rel))


def test_the_render_side_asks_its_kinds():
    assert "implementer/template_context.py" not in _outside_homes()
    homes = [p for p in (ROOT / "implementer" / "kinds").glob("*.py") if kind_branches(p.read_text(encoding="utf-8"))]
    assert homes, "the kinds' own modules are where the branches went"


def test_each_shape_of_kind_branch_is_found():
    """Negative controls: the three shapes a port of a new kind would scatter."""
    assert kind_branches("if m.dsa is not None:\n    pass\n") == [1]
    assert kind_branches("x = 1\nok = layer.attn_type == MAMBA\n") == [2]
    assert kind_branches('ok = layer.layer_kind in ("linear", "chunked")\n') == [1]
    assert kind_branches("ok = layer.group_key != layer.attn_type\n") == []
    assert kind_branches('entries = {"Mamba": 1}\n') == [1]
    assert kind_branches("x = m.mla.enabled and m.fa.version\n") == [1]
    assert kind_branches("y = 2 if not m.linear_attention else 3\n") == [1]
    assert kind_branches("kind = plan.family\nif spec.windowed:\n    pass\n") == []
    assert kind_branches("dims = m.model.mla\nrows.append(('mla', facts.mla.value, dims))\n") == []  # data, no branch
