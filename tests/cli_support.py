"""Helpers shared by the test suites: run the `kvcache` entry in-process, snapshot folders byte for byte, save a
transformers config as a config.json."""

from __future__ import annotations

import os
from pathlib import Path

from model_infer_kvcache import cli as kvcache_cli


def snapshot(*folders: Path) -> dict[str, bytes | None]:
    """Every path under the folders (hidden ones too): a file's bytes, None for a folder, a link's target,
    a marker for a FIFO or socket (reading one would block)."""
    out: dict[str, bytes | None] = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_symlink():
                out[str(p)] = f"-> {os.readlink(p)}".encode()
            elif p.is_dir():
                out[str(p)] = None
            else:
                out[str(p)] = p.read_bytes() if p.is_file() else b"<special>"
    return out


def invoke(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `kvcache ARGV` run in this process."""
    try:
        rc = kvcache_cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def saved_config(config, tmp: Path, name: str, **changes) -> Path:
    """``config`` (a transformers config object) saved the way a user saves a config.json, bfloat16, with
    ``changes`` applied (a value of None drops the key)."""
    import json

    data = config.to_dict()
    data["torch_dtype"] = "bfloat16"
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(data, default=str), encoding="utf-8")
    return path
