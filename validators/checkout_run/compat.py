"""transformers 4.x meanings a checkout's own config classes rely on, kept for one run under transformers 5.

A checkout written against transformers 4.x reads ``config.rope_scaling`` and takes ``None`` for "no
RoPE scaling" (``if self.config.rope_scaling is not None: factor = rope_scaling["factor"]``). Under
transformers 5 ``rope_scaling`` is an alias of ``rope_parameters``, which always holds a dict, with
``rope_type: "default"`` when nothing is scaled: the 4.x code then reads a ``factor`` that does not
exist. ``legacy_rope_scaling(config_cls)`` gives a checkout config class that reads ``rope_scaling``
the 4.x answer (``None`` for the default type, the dict otherwise) for the scope of one run.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

# rope types that scale nothing: transformers 4.x wrote no rope_scaling for them
UNSCALED_ROPE_TYPES = ("default",)


def _reads_rope_scaling(config_cls: type) -> bool:
    """The class is the checkout's own (not transformers') and its module reads ``rope_scaling``."""
    if config_cls.__module__.startswith("transformers."):
        return False
    try:
        return "rope_scaling" in inspect.getsource(inspect.getmodule(config_cls))
    except (OSError, TypeError):
        return False


def legacy_rope_value(value):
    """The 4.x ``rope_scaling`` of a transformers 5 ``rope_parameters`` value."""
    if isinstance(value, dict) and value.get("rope_type", value.get("type", "default")) in UNSCALED_ROPE_TYPES \
            and "factor" not in value:
        return None
    return value


@contextlib.contextmanager
def legacy_rope_scaling(config_cls: type) -> Iterator[bool]:
    """Install the 4.x ``rope_scaling`` reading on ``config_cls`` (yields whether it did); undone on exit."""
    base = next((getattr(k, "__dict__", {}).get("rope_scaling") for k in config_cls.__mro__
                 if isinstance(getattr(k, "__dict__", {}).get("rope_scaling"), property)), None)
    if base is None or "rope_scaling" in config_cls.__dict__ or not _reads_rope_scaling(config_cls):
        yield False
        return

    def fget(self):
        return legacy_rope_value(base.fget(self))

    config_cls.rope_scaling = property(fget, base.fset, base.fdel, base.__doc__)
    try:
        yield True
    finally:
        del config_cls.rope_scaling


def _alias_target(prop: property) -> str | None:
    """``X`` when the property's getter is exactly ``return self.X`` (an alias of another field)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # docstring
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Attribute) \
            and isinstance(body[0].value.value, ast.Name) and body[0].value.value.id == "self":
        return body[0].value.attr
    return None


def json_key(value) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)


def _init_parameters(config_cls: type) -> set[str]:
    """Every parameter an ``__init__`` of the class or its bases takes: a subclass passing ``**kwargs`` on
    (upstream Qwen3Config(head_dim, attention_bias, **kwargs) over a base taking rope_theta) takes its base's."""
    names: set[str] = set()
    for klass in config_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            names |= {n for n, p in inspect.signature(init).parameters.items()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        except (TypeError, ValueError):
            continue
    return names


def _transformers_aliases(model_type) -> dict[str, str]:
    """transformers' ``attribute_map`` (old name -> field) of the config class of ``model_type``; {} without one."""
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    except ImportError:
        cls = None
    return dict(getattr(cls, "attribute_map", {}) or {})


def fit_to_config_class(config: dict, config_cls: type) -> tuple[dict, list[str]]:
    """The checkpoint's config.json as the checkout's config class can read it: a field the class defines
    as a read-only property (``num_hidden_layers`` returning ``self.num_layers``) cannot be set from the
    file; when the property is an alias its value moves to the aliased field, else it is dropped.
    Returns the fitted dict and one note per field moved or dropped."""
    out, notes = dict(config), []
    # transformers 4.x configs carried rope_theta at the top level; 5.x moved it into rope_parameters. A
    # checkout class that still takes rope_theta would otherwise fall back to its own default.
    takes = _init_parameters(config_cls)
    rope = out.get("rope_parameters")
    if "rope_theta" in takes and "rope_theta" not in out and isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        notes.append(f"the checkout's {config_cls.__name__} takes rope_theta (transformers 4.x): written from "
                     f"rope_parameters ({rope['rope_theta']:g})")
    # transformers 5 renamed fields and keeps the old name as an attribute_map alias (Qwen3MoeConfig: num_experts ->
    # num_local_experts), and writes the new name; a checkout class taking the old name would read its own default.
    for alias, real in _transformers_aliases(out.get("model_type")).items():
        if alias in takes and real not in takes and real in out and alias not in out:
            out[alias] = out[real]
            notes.append(f"the checkout's {config_cls.__name__} takes {alias} (transformers 4.x), transformers 5 "
                         f"writes {real}: written as {alias}={out[alias]!r}")
    overrides = out.get("per_layer_config")
    if isinstance(overrides, dict) and "per_layer_config" not in takes:
        # transformers 5's per-layer overrides (Gemma-4: the full-attention layers' head_dim and KV heads) of a
        # class that reads the published global_* fields instead (global_head_dim, num_global_key_value_heads)
        out.pop("per_layer_config")
        common = {}
        for layer in overrides.values():
            for key, value in (layer or {}).items():
                common.setdefault(key, set()).add(json_key(value))
        for key, values in common.items():
            names = [f"global_{key}"] + ([f"num_global_{key[4:]}"] if key.startswith("num_") else [])
            name = next((n for n in names if n in takes), None)
            if name and len(values) == 1:
                out[name] = next(iter(overrides.values()))[key]
                notes.append(f"the checkout's {config_cls.__name__} reads {name}, not per_layer_config: "
                             f"written from the overrides of layers {sorted(overrides)} ({key}={out[name]!r})")
            else:
                notes.append(f"the checkout's {config_cls.__name__} takes no per_layer_config: the per-layer "
                             f"{key} of layers {sorted(overrides)} is not passed on")
    for name in list(out):
        prop = next((k.__dict__[name] for k in config_cls.__mro__
                     if k.__module__ != "builtins" and name in getattr(k, "__dict__", {})), None)
        if not isinstance(prop, property) or prop.fset is not None \
                or getattr(config_cls, "__module__", "").startswith("transformers."):
            continue
        if any(name in getattr(k, "__dict__", {}) for k in config_cls.__mro__ if k.__module__.startswith("transformers.")):
            continue  # transformers' own properties (rope_scaling...) are not the checkout's
        value = out.pop(name)
        target = _alias_target(prop)
        if target and target in out:  # the file sets the aliased field itself: it wins
            notes.append(f"the checkout's {config_cls.__name__} reads {name} as self.{target}: the file's "
                         f"{target}={out[target]!r} is kept ({name}={value!r} not written)")
        elif target and target != name:
            out[target] = value
            notes.append(f"the checkout's {config_cls.__name__} reads {name} as self.{target}: the tiny "
                         f"{name}={value!r} is written as {target}")
        else:
            notes.append(f"the checkout's {config_cls.__name__} computes {name} (a read-only property): "
                         f"not written to its config.json")
    return out, notes


def fit_checkpoint_config(checkpoint, config_cls: type) -> list[str]:
    """``fit_to_config_class`` applied to ``checkpoint/config.json`` in place (idempotent); its notes."""
    import json
    from pathlib import Path

    path = Path(checkpoint) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    fitted, notes = fit_to_config_class(config, config_cls)
    if fitted != config:
        from model_infer_kvcache.analyzer.files import atomic_write_text

        atomic_write_text(path, json.dumps(fitted, indent=2, default=str) + "\n")
    return notes


def set_config_field(config, name: str, value) -> None:
    """``config.name = value``, through the aliased field when the class computes ``name`` read-only."""
    prop = getattr(type(config), name, None)
    if isinstance(prop, property) and prop.fset is None:
        target = _alias_target(prop)
        if target is None:
            raise AttributeError(f"{type(config).__name__}.{name} is computed (read-only) and not an alias")
        name = target
    setattr(config, name, value)


class _Renamed:
    """A cache entry seen under the manifest's name (every other attribute is the entry's own)."""

    def __init__(self, entry, name: str):
        self._entry, self.cache_name = entry, name

    def __getattr__(self, attr):
        return getattr(self._entry, attr)


def entries_named_by_the_manifest(info, manifest):
    """``(info, mapping)``: when a layer's entry names differ from the manifest's but pair one to one by
    width (``dim``; a recurrent state by its ``shape``) with them, a view of ``info`` whose entries carry the
    manifest's names (the names are the model's own choice; what is checked is what each entry holds), and the
    names paired, else ``(info, {})``."""
    import types

    mapping: dict[str, str] = {}
    layers = []
    for plan, layer in zip(manifest.layers, info.layer_infos, strict=False):
        got = {e.cache_name: e for e in layer.caches}
        planned = plan.states if plan.is_state else plan.caches
        want = {c.name: c for c in planned}
        pairs = {}
        if set(got) != set(want) and len(got) == len(want):
            def width(e, state=plan.is_state):
                return tuple(getattr(e, "shape", None) or ()) if state else getattr(e, "dim", None)

            by_dim = {}
            for c in planned:
                by_dim.setdefault(tuple(c.shape) if plan.is_state else c.dim, []).append(c.name)
            for name, e in got.items():
                names = by_dim.get(width(e), [])
                if len(names) == 1:
                    pairs[name] = names[0]
            if len(pairs) != len(got) or len(set(pairs.values())) != len(pairs):
                return info, {}
        mapping.update(pairs)
        layers.append(types.SimpleNamespace(**{**vars(layer), "caches": [
            _Renamed(e, pairs[e.cache_name]) if e.cache_name in pairs else e for e in layer.caches]})
            if pairs else layer)
    if not mapping:
        return info, {}
    view = types.SimpleNamespace(**{k: getattr(info, k) for k in dir(info) if not k.startswith("_")
                                    and not callable(getattr(info, k))})
    view.layer_infos = layers + list(info.layer_infos)[len(layers):]
    return view, mapping
