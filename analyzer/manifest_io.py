"""The one manifest loader: JSON or YAML from a file, with the manifest's invariants checked.

Every command that reads a manifest (`kvcache render|validate|lint --manifest`) loads it here, so
they accept the same files and refuse bad ones with the same one line: an ``InputError`` naming the
file and the first bad field.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import json_syntax_problem, read_input_text
from model_infer_kvcache.analyzer.kv_cache_spec import PLANNED_ATTN_TYPES
from model_infer_kvcache.analyzer.manifest import (
    SCHEMA_VERSION,
    AttentionLayerPlan,
    ManifestInvariantError,
    SelectionManifest,
    StateLayerPlan,
)

LAYER_PLANS = (AttentionLayerPlan, StateLayerPlan)

YAML_SUFFIXES = (".yaml", ".yml")


def load_manifest(path: str | Path) -> SelectionManifest:
    """Read and validate a manifest (YAML by suffix, else JSON); every problem is one ``InputError``."""
    p = Path(path)
    text = read_input_text(p).removeprefix("\ufeff")  # an editor's byte-order mark is not content
    try:
        if p.suffix in YAML_SUFFIXES:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
                raise InputError(str(p), f"not a valid selection manifest: invalid YAML{at}: "
                                         f"{getattr(exc, 'problem', None) or exc}") from None
            _refuse_other_version(p, data)
            _refuse_mistagged_layer(p, data)
            return _section_rules_hold(p, SelectionManifest.model_validate(data))
        data = _json_or_none(text)
        _refuse_other_version(p, data)
        _refuse_mistagged_layer(p, data)
        return _section_rules_hold(p, SelectionManifest.model_validate_json(text))
    except InputError:
        raise
    except RecursionError:
        raise InputError(str(p), "not a valid selection manifest: nested too deeply") from None
    except Exception as exc:  # pydantic ValidationError / yaml errors: name the first bad field
        first = getattr(exc, "errors", lambda: [])()
        if first and first[0]["type"] == "json_invalid":
            _refuse_json_syntax(p, text)
        field = ".".join(str(x) for x in _without_tags(first[0]["loc"])) if first else None
        msg = first[0]["msg"] if first else str(exc).splitlines()[0]
        broken = first[0].get("ctx", {}).get("error") if first else None
        if isinstance(broken, ManifestInvariantError):  # fields that contradict each other (hand edit)
            field, msg = broken.field, broken.message
        raise InputError(str(p), f"not a valid selection manifest: {msg}", field=field) from None


def _section_rules_hold(p: Path, m: SelectionManifest) -> SelectionManifest:
    """The rules a section's fields follow where the manifest's own invariant cannot ask them (they read the rules,
    which read the manifest): BLT's byte_patches (scale from head_dim, band from window)."""
    if m.byte_patches is not None:
        from model_infer_kvcache.analyzer.kinds import byte_patch_section

        found = byte_patch_section.problems(m.byte_patches)
        if found:
            raise InputError(str(p), f"not a valid selection manifest: {found[0][1]}", field=found[0][0])
    return m


def _without_tags(loc: tuple) -> list:
    """pydantic's error location without the tag of a layer plan (``layers.3.FullAttention.sparse_mode`` ->
    ``layers.3.sparse_mode``): the user's file has no such key."""
    return [x for i, x in enumerate(loc) if not (i and isinstance(loc[i - 1], int) and x in PLANNED_ATTN_TYPES)]


def _refuse_mistagged_layer(p: Path, data) -> None:
    """A layer whose fields are another kind's plan, complete, while its own kind's are missing: the attn_type is
    what is wrong (pydantic would name the first missing field instead, e.g. a state layer retagged FullAttention
    reported as missing sparse_mode)."""
    layers = data.get("layers") if isinstance(data, dict) else None
    for i, layer in enumerate(layers if isinstance(layers, list) else []):
        tag = layer.get("attn_type") if isinstance(layer, dict) else None
        own = next((k for k in LAYER_PLANS if tag in k.model_fields["attn_type"].annotation.__args__), None)
        if own is None:
            continue  # an unknown attn_type: pydantic names it
        other = [k for k in LAYER_PLANS if k is not own and _required(k) <= layer.keys()]
        if other and not _required(own) <= layer.keys():
            kind = other[0].model_fields["attn_type"].annotation.__args__
            raise InputError(str(p), f"not a valid selection manifest: attn_type {tag} plans {own.plans}, but "
                                     f"the layer carries the fields of attn_type {'/'.join(kind)} and none of "
                                     f"{', '.join(sorted(_required(own) - layer.keys()))}",
                             field=f"layers.{i}.attn_type")


def _required(kind) -> set[str]:
    return {name for name, f in kind.model_fields.items() if f.is_required()}


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None  # the syntax error is reported by the full validation below, in its own words


def _refuse_other_version(p: Path, data) -> None:
    """A manifest of another schema version is refused by its version before any field of it is read (a 1.0
    manifest's state layers carry FA fields 2.0 has not: the field error would hide the real cause)."""
    version = data.get("schema_version", SCHEMA_VERSION) if isinstance(data, dict) else SCHEMA_VERSION
    if version != SCHEMA_VERSION:
        raise InputError(str(p), f"not a valid selection manifest: schema_version {version!r} is not the supported "
                                 f"{SCHEMA_VERSION!r}: re-run kvcache analyze with the same inputs (references/"
                                 "manifest.md, 'schema 版本与迁移')", field="schema_version")


def _refuse_json_syntax(p: Path, text: str) -> None:
    """The JSON syntax error in the words `kvcache analyze --config` uses (pydantic's own line reads
    "Invalid JSON: EOF while parsing an object"); returns when json itself accepts the text."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(p), f"not a valid selection manifest: {json_syntax_problem(exc)}") from None
    except RecursionError:
        raise InputError(str(p), "not a valid selection manifest: nested too deeply") from None
