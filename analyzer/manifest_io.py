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
from model_infer_kvcache.analyzer.manifest import ManifestInvariantError, SelectionManifest

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
            return SelectionManifest.model_validate(data)
        return SelectionManifest.model_validate_json(text)
    except InputError:
        raise
    except RecursionError:
        raise InputError(str(p), "not a valid selection manifest: nested too deeply") from None
    except Exception as exc:  # pydantic ValidationError / yaml errors: name the first bad field
        first = getattr(exc, "errors", lambda: [])()
        if first and first[0]["type"] == "json_invalid":
            _refuse_json_syntax(p, text)
        field = ".".join(str(x) for x in first[0]["loc"]) if first else None
        msg = first[0]["msg"] if first else str(exc).splitlines()[0]
        broken = first[0].get("ctx", {}).get("error") if first else None
        if isinstance(broken, ManifestInvariantError):  # fields that contradict each other (hand edit)
            field, msg = broken.field, broken.message
        raise InputError(str(p), f"not a valid selection manifest: {msg}", field=field) from None


def _refuse_json_syntax(p: Path, text: str) -> None:
    """The JSON syntax error in the words `kvcache analyze --config` uses (pydantic's own line reads
    "Invalid JSON: EOF while parsing an object"); returns when json itself accepts the text."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(p), f"not a valid selection manifest: {json_syntax_problem(exc)}") from None
    except RecursionError:
        raise InputError(str(p), "not a valid selection manifest: nested too deeply") from None
