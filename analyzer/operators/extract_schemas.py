"""Regenerate ``op_schemas.json`` from a downloaded ``torch-npu`` wheel.

Not needed at test time: tests read the committed JSON. Run it by hand when the
pinned torch-npu version changes::

    pip download torch-npu==2.9.0 --no-deps -d /tmp/tnpu
    python -m model_infer_kvcache.analyzer.operators.extract_schemas /tmp/tnpu/torch_npu-2.9.0-*.whl

The argument may also be an unpacked wheel directory or the yaml file itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

import yaml
from model_infer_kvcache.analyzer.errors import OneLineArgumentParser
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.analyzer.operators.schemas import (
    EMULATED_OPS,
    SCHEMA_PATH,
    emulated_ops_in,
    parse_func_schema,
)

YAML_IN_WHEEL = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def _read_yaml_text(source: Path) -> tuple[str, str]:
    """Return (yaml text, human-readable origin) from a wheel, a directory or a yaml file."""
    if source.is_dir():
        path = source / YAML_IN_WHEEL
        return path.read_text(encoding="utf-8"), str(path)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            return wheel.read(YAML_IN_WHEEL).decode("utf-8"), f"{source.name}:{YAML_IN_WHEEL}"
    return source.read_text(encoding="utf-8"), source.name


def _iter_func_strings(doc: object):
    """Yield every ``func:`` string anywhere in the yaml document (sections vary by version)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "func" and isinstance(value, str):
                yield value
            else:
                yield from _iter_func_strings(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _iter_func_strings(item)


def extract(yaml_text: str, ops: tuple[str, ...] = EMULATED_OPS) -> dict[str, dict]:
    found: dict[str, str] = {}
    for func in _iter_func_strings(yaml.safe_load(yaml_text)):
        name = func.split("(", 1)[0].strip()
        if name not in ops:
            continue
        # The yaml lists some ops twice (e.g. "custom" and "symint" sections); they must agree.
        if name in found and found[name] != func.strip():
            raise ValueError(f"conflicting schemas for {name}:\n{found[name]}\n{func}")
        found[name] = func.strip()
    missing = [op for op in ops if op not in found]
    if missing:
        raise ValueError(f"operators not found in the yaml: {missing}")
    result = {}
    for op in ops:
        parsed = parse_func_schema(found[op])
        result[op] = {"func": found[op], "args": parsed["args"], "returns": parsed["returns"]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m model_infer_kvcache.analyzer.operators.extract_schemas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="torch_npu wheel, unpacked wheel dir, or the yaml file")
    parser.add_argument("--version", default="2.9.0", help="torch-npu version recorded in 'source'")
    parser.add_argument("--out", type=Path, default=SCHEMA_PATH)
    args = parser.parse_args(argv)
    text, origin = _read_yaml_text(args.source)
    doc = {
        "source": f"torch-npu=={args.version} ({origin})",
        "ops": extract(text, emulated_ops_in(args.version)),  # an operator newer than the release is left out
    }
    atomic_write_text(args.out, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {len(doc['ops'])} operator schemas to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
