"""The parallel layout a checkout's model is validated at: what its folder serves, and what its code refuses.

kvcache runs a checkout's model at one rank, or at attention TP = MoE TP = N over N gloo ranks (MoE EP 1). A
folder's yamls say which layouts it is served at on the device (``parallel_config``: world_size, attn_tp_size,
moe_tp_size), but not which of kvcache's layouts its code accepts: Qwen3-MoE and DeepSeek are served at
attn_tp_size 1 (EP 16-128) and still cannot run on one rank, whose expert-parallel path reads a communication
group the engine registers only with more than one rank. That is the model's own code speaking, so the first
run tells: ``rank_refusal`` recognises a failure that only the world size causes, and ``validate_checkout``
then starts the judged run at attention TP 2 (when the user left the layout to kvcache) and says so.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

TRY_NEXT = 2  # the next layout kvcache runs: attention TP = MoE TP = 2, two gloo ranks


@dataclass(frozen=True)
class ServedLayout:
    """One yaml of the folder: the layout it serves the model at on the device."""

    yaml: str  # path relative to the checkout
    world_size: int | None
    attn_tp_size: int | None
    moe_tp_size: int | None


def served_layouts(root: Path, folders: list[str]) -> list[ServedLayout]:
    """Every ``models/<folder>/config/**/*.yaml`` with a parallel layout."""
    out = []
    for name, data in _folder_yamls(root, folders):
        par = data.get("parallel_config") if isinstance(data.get("parallel_config"), dict) else {}
        layout = ServedLayout(name, _size(par, data, "world_size"), _size(par, data, "attn_tp_size"),
                              _size(par, data, "moe_tp_size"))
        if layout.world_size or layout.attn_tp_size or layout.moe_tp_size:
            out.append(layout)
    return out


def _folder_yamls(root: Path, folders: list[str]):
    """(path relative to the checkout, mapping) of every ``models/<folder>/config/**/*.yaml``; unparseable yamls
    are skipped: they configure the device run, not ours."""
    import yaml

    for folder in folders:
        for path in sorted((root / "models" / folder / "config").rglob("*.yaml")):
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if isinstance(data, dict):
                yield str(path.relative_to(root)), data


def served_next_n(root: Path, folders: list[str]) -> dict[str, int]:
    """``model_config.next_n`` of every yaml of the folders (the framework's default 0 where a yaml sets none):
    the speculative depth the folder is served at."""
    out = {}
    for name, data in _folder_yamls(root, folders):
        model = data.get("model_config")
        value = model.get("next_n", 0) if isinstance(model, dict) else 0
        out[name] = value if isinstance(value, int) and not isinstance(value, bool) else 0
    return out


def served_exe_modes(root: Path, folders: list[str]) -> dict[str, str]:
    """``model_config.exe_mode`` of every yaml of the folders that names one: how the folder is served."""
    out = {}
    for name, data in _folder_yamls(root, folders):
        model = data.get("model_config")
        value = model.get("exe_mode") if isinstance(model, dict) else data.get("exe_mode")
        if isinstance(value, str):
            out[name] = value
    return out


def exe_mode_note(asked: str, by_yaml: dict[str, str]) -> str:
    """What a checkout run in graph mode says of the folder's own execution modes."""
    served = sorted(set(by_yaml.values()))
    yamls = (f"its {len(by_yaml)} yaml(s) serve exe_mode {'/'.join(served)}" if by_yaml
             else "its folder has no yaml naming an exe_mode")
    tail = "" if asked in served else f"; {asked} is not among them, so a capture finding may be why"
    return f"decode captured as exe_mode {asked} (--exe-mode): {yamls}{tail}"


def speculation_note(next_n_by_yaml: dict[str, int], planned: int) -> str:
    """What a checkout run says of a config with MTP layers: the engine runs at the framework's next_n 0."""
    served = sorted(set(next_n_by_yaml.values()))
    yamls = (f"its {len(next_n_by_yaml)} yaml(s) serve next_n {'/'.join(map(str, served))}" if next_n_by_yaml
             else "its folder has no yaml")
    return (f"speculative decoding not run in the engine: the config has {planned} MTP layer(s), the engine runs at "
            f"next_n 0 (the framework's default; {yamls}), so no verify step is judged here; the rendered path "
            "validates verify steps (kvcache run / validate --rendered)")


def _size(parallel: dict, top: dict, key: str) -> int | None:
    """``parallel_config.<key>``, else the yaml's top-level key (pangu_7b's world_size)."""
    value = parallel.get(key, top.get(key))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def describe_served(served: list[ServedLayout]) -> str:
    """One phrase: ``its 6 yamls serve world_size 16/128, attn_tp_size 1/16, moe_tp_size 1/16``."""
    if not served:
        return "its folder has no yaml with a parallel_config"

    def values(name: str) -> str:
        found = sorted({getattr(s, name) for s in served if getattr(s, name) is not None})
        return "/".join(map(str, found)) or "-"

    n = len(served)
    return (f"its {n} yaml{'s' if n > 1 else ''} serve{'' if n > 1 else 's'} world_size {values('world_size')}, "
            f"attn_tp_size {values('attn_tp_size')}, moe_tp_size {values('moe_tp_size')}")


def layout_phrase(world: int) -> str:
    if world == 1:
        return "one rank (attention TP 1, MoE TP 1)"
    return f"{world} gloo ranks (attention TP {world}, MoE TP {world}, MoE EP 1)"


def rank_refusal(exc: BaseException, world: int) -> str | None:
    """Why the model's code cannot run at this world size, when ``exc`` says so; None for any other failure.

    At one rank: a communication group the engine registers only with more than one rank (the executor's
    comm_manager: ``Communication group '<name>' not found``), or a None read where the model keeps its groups
    (``hccl_comm_dict``, ``*_group``) built only for world_size > 1. At any world size: the model's own check of
    its parallel sizes (an assertion or error naming tp/ep/dp/world size: LongCat-Flash's AFD path raises
    "only supported when world_size % 2 == 0" at one rank)."""
    frames = traceback.extract_tb(exc.__traceback__)
    line = (frames[-1].line or "") if frames else ""
    if world == 1:
        if isinstance(exc, KeyError) and "Communication group" in str(exc):
            return "the model registers that group only with more than one rank"
        if isinstance(exc, AttributeError) and "NoneType" in str(exc) and re.search(r"hccl|comm|group", line):
            return "the model builds its communication groups only with more than one rank, and this line reads them"
    return size_check(type(exc).__name__, f"{exc} {line}")


# a parallel size named in the check: attn_tp_size, moe_ep_size, tp_rank, world_size (not step_size, hidden_size)
_SIZES = re.compile(r"\b(\w+_)?(tp|ep|dp|cp)_(size|rank|world_size)\b|\bworld[_ ]size\b", re.IGNORECASE)


def size_check(exc_type: str, text: str) -> str | None:
    """The model's own check of its parallel sizes (``assert num_heads % attn_tp_size == 0``...)."""
    if exc_type in ("AssertionError", "ValueError", "NotImplementedError", "RuntimeError") and _SIZES.search(text):
        return "the model's own check of its parallel sizes refuses this layout"
    return None


class RanksRefused(Exception):
    """The model's code refused the layout kvcache chose (not the user): try the next one."""

    def __init__(self, where: str, reason: str):
        self.where = where  # "modeling_x.py:423: KeyError: ..."
        self.reason = reason
        super().__init__(f"{where} ({reason})")


def chosen_by_kvcache(req, world: int) -> bool:
    """The layout is kvcache's choice: one rank, no --attn-tp-size, no manifest fixing attn_tp_size."""
    return world == 1 and req.attn_tp_size is None and not req.manifest
