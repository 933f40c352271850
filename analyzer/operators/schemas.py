"""Real ``torch_npu`` operator schemas, as extracted from the ``torch-npu`` wheel.

The committed ``op_schemas.json`` (torch-npu 2.9.0, the pin) is the single source of truth for
the argument names, order, keyword-only marker and defaults of every operator this bundle
emulates; ``op_schemas-2.14.0.json`` holds the same operators from a newer release, so that lint
can say in which release a keyword was added. It is produced by ``extract_schemas.py`` from a downloaded wheel; tests
and every part of the bundle (templates context, linter, emulator, validation checks,
doc tables) read the JSON through this module, never the wheel. Stdlib only: the
implementer and the linter import it without torch.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("op_schemas.json")
# The release every part of the bundle emulates and validates against (SCHEMA_PATH).
PINNED_RELEASE = "2.9.0"
# Every release whose schemas are committed, oldest first: lint judges a keyword against the release a
# model folder targets (``validators.lint.target_release``). Each file holds the emulated operators its release
# defines (``emulated_ops_in``): the same list, less an operator a release lacks (npu_chunk_gated_delta_rule: 2.14.0).
RELEASE_PATHS: dict[str, Path] = {
    PINNED_RELEASE: SCHEMA_PATH,
    "2.14.0": Path(__file__).with_name("op_schemas-2.14.0.json"),
}
RELEASES: tuple[str, ...] = tuple(RELEASE_PATHS)

# The operators the bundle's emulator implements (and therefore pins); the loader below reads
# whatever operators the JSON holds, so pinning one more is an entry here plus a re-extraction.
EMULATED_OPS: tuple[str, ...] = (
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "scatter_update",
    "scatter_update_",
    "npu_kv_rmsnorm_rope_cache",
    "npu_kv_rmsnorm_rope_cache_v2",
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_rotary_mul",
    "npu_apply_rotary_pos_emb",
    "npu_interleave_rope",
    "npu_swiglu",
    "npu_geglu",
    "npu_format_cast",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing",
    "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_transpose_batchmatmul",
    "npu_moe_re_routing",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2",
    "npu_mla_prolog_v3",
    "npu_lightning_indexer",
    "npu_sparse_flash_attention",
    "npu_recurrent_gated_delta_rule",
    "npu_chunk_gated_delta_rule",  # torch-npu 2.14.0 only: pinned from that release (schema_release)
)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses/brackets (``Tensor(a!)`` has parentheses)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    tail = "".join(current).strip()
    if tail:
        parts.append(tail)
    return parts


def parse_func_schema(func: str) -> dict[str, Any]:
    """Parse a native-functions ``func:`` string into name, args and returns.

    ``args`` entries are ``{"name", "type", "default", "kwarg_only"}``; ``default`` is the
    raw default text from the schema (``None`` when the argument has no default).
    """
    func = func.strip()
    open_idx = func.index("(")
    name = func[:open_idx].strip()
    depth = 0
    close_idx = -1
    for i in range(open_idx, len(func)):
        if func[i] == "(":
            depth += 1
        elif func[i] == ")":
            depth -= 1
            if depth == 0:
                close_idx = i
                break
    if close_idx < 0:
        raise ValueError(f"unbalanced parentheses in schema: {func!r}")
    arg_text = func[open_idx + 1 : close_idx]
    rest = func[close_idx + 1 :].strip()
    if not rest.startswith("->"):
        raise ValueError(f"schema has no return annotation: {func!r}")
    returns = rest[2:].strip()

    args: list[dict[str, Any]] = []
    kwarg_only = False
    for raw in _split_top_level(arg_text):
        if raw == "*":
            kwarg_only = True
            continue
        default: str | None = None
        decl = raw
        if "=" in raw:
            decl, default = raw.split("=", 1)
            decl, default = decl.strip(), default.strip()
        type_str, arg_name = decl.rsplit(None, 1)
        args.append({"name": arg_name, "type": type_str.strip(), "default": default, "kwarg_only": kwarg_only})
    return {"name": name, "args": args, "returns": returns}


def schema_default_to_python(default: str | None) -> Any:
    """Convert a schema default literal (``None``, ``1.0``, ``"BSH"``, ``'Norm'``, ``False``) to Python."""
    if default is None:
        raise ValueError("argument has no default")
    text = default.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text == "[]":
        return []
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        return float(text)


def count_returns(returns: str) -> int:
    """Number of values an operator returns (``(Tensor, Tensor)`` -> 2, ``Tensor(a!)`` -> 1)."""
    text = returns.strip()
    if not text.startswith("("):
        return 1
    inner = text[1:-1].strip()
    return len(_split_top_level(inner)) if inner else 0


@cache
def _load_cached(release: str) -> str:
    if release not in RELEASE_PATHS:
        raise KeyError(f"no committed schemas for torch-npu {release}; known: {list(RELEASES)}")
    return RELEASE_PATHS[release].read_text(encoding="utf-8")


def load_schemas(release: str = PINNED_RELEASE) -> dict[str, Any]:
    """Return a committed schema document: ``{"source": str, "ops": {name: {...}}}``."""
    return json.loads(_load_cached(release))


@cache
def _ops(release: str) -> dict[str, Any]:
    return load_schemas(release)["ops"]


def op_schema(op_name: str, release: str = PINNED_RELEASE) -> dict[str, Any]:
    ops = _ops(release)
    if op_name not in ops:
        raise KeyError(f"no pinned schema for operator {op_name!r}; known: {sorted(ops)}")
    return ops[op_name]


def accepted_keywords(op_name: str, release: str = PINNED_RELEASE) -> frozenset[str]:
    """Every argument name ``op_name`` accepts (positional ones can also be passed by keyword)."""
    return frozenset(arg["name"] for arg in op_schema(op_name, release)["args"])


def releases_accepting(op_name: str, keyword: str) -> tuple[str, ...]:
    """The committed releases whose schema of ``op_name`` has ``keyword`` (oldest first)."""
    return tuple(r for r in RELEASES if op_name in _ops(r) and keyword in accepted_keywords(op_name, r))


def op_arg(op_name: str, arg_name: str) -> dict[str, Any]:
    """The schema entry of one argument (``name``, ``type``, ``default``, ``kwarg_only``)."""
    for arg in op_schema(op_name)["args"]:
        if arg["name"] == arg_name:
            return arg
    raise KeyError(f"{arg_name!r} is not an argument of {op_name}")


def arg_position(op_name: str, arg_name: str) -> int:
    """Index of ``arg_name`` in the operator's argument list (where a positional call passes it)."""
    return [arg["name"] for arg in op_schema(op_name)["args"]].index(op_arg(op_name, arg_name)["name"])


def default_text(op_name: str, arg_name: str) -> str | None:
    """The schema's default literal of one argument (``"1.0"``, ``"None"``), None when it has none."""
    return op_arg(op_name, arg_name)["default"]


def default_value(op_name: str, arg_name: str) -> Any:
    """The Python value the operator uses when ``arg_name`` is not passed."""
    return schema_default_to_python(default_text(op_name, arg_name))


NAMES_PATH = Path(__file__).with_name("op_names.json")


@cache
def releases_defining(op: str) -> tuple[str, ...]:
    """The committed releases whose torch-npu defines an operator named ``op`` (``op_names.json``: every op of
    the wheel, not only the emulated ones); empty for a name no release has."""
    releases = json.loads(NAMES_PATH.read_text(encoding="utf-8"))["releases"]
    return tuple(release for release, names in releases.items() if op in names)


def emulated_ops_in(release: str) -> tuple[str, ...]:
    """The emulated operators torch-npu ``release`` defines (``op_names.json``); every one for a release that
    file does not list (a new wheel being extracted)."""
    releases = json.loads(NAMES_PATH.read_text(encoding="utf-8"))["releases"]
    if release not in releases:
        return EMULATED_OPS
    return tuple(op for op in EMULATED_OPS if op in releases[release])


def schema_release(op: str) -> str:
    """The committed release an emulated operator's signature is pinned to: the pinned release when it defines
    the operator, else the oldest committed release that does (the operator is newer than the pin)."""
    for release in (PINNED_RELEASE, *RELEASES):
        if op in _ops(release):
            return release
    raise KeyError(f"no committed schema release defines {op!r}")
