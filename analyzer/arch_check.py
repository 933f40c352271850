"""Cross-check the analyzer's plan (softmax scale, per-layer window, KV cache shape, sinks, which layers attend)
against the architecture's own code.

When transformers is installed and ships the model type, the model is built on the meta device
(real config, no weights, no memory) and each decoder block reports its attention module's scale, window, k/v
projection shape and sinks, and any recurrent mixer beside it.
A disagreement means the analyzer's rules are wrong for this architecture: the caller refuses to
write the manifest. transformers stays optional: without it nothing is checked.

Importing transformers and building the meta model costs seconds, more than the rest of `kvcache analyze`
together, yet its answer depends only on the installed transformers and the config's architecture section.
What transformers reports (whether it ships the type, each module's scale and window, or why it could not
build) is therefore kept in a user cache (``transformers_report``, folder ``cache_dir()``) keyed by exactly those; the comparison with the
analyzer's plan runs on every call. A missing, corrupt or unwritable cache only costs the build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_infer_kvcache.analyzer.config_loader import HF_MODEL_TYPE, ModelFacts, model_section
from model_infer_kvcache.analyzer.errors import InputError
from model_infer_kvcache.analyzer.files import atomic_write_text
from model_infer_kvcache.analyzer.kinds import byte_patches as byte_patches_kind
from model_infer_kvcache.analyzer.kinds import cross as cross_kind
from model_infer_kvcache.analyzer.kinds import loops as loops_kind
from model_infer_kvcache.analyzer.kinds.diff import HF_FACT as DIFF_FACT
from model_infer_kvcache.analyzer.kinds.formats import format_of, hf_module_facts
from model_infer_kvcache.analyzer.kinds.gqa import MASK_REWRITTEN
from model_infer_kvcache.analyzer.kinds.invariants import DIFF_CACHES
from model_infer_kvcache.analyzer.linear_config import (
    LINEAR_MODULE_SUFFIXES,
    MIXER_FACT,
    NO_CACHE,
    cca_facts,
    kvcache_reference,
    mixer_facts,
    mixer_off,
    mlstm_facts,
    rg_lru_facts,
    rwkv_facts,
    short_conv_facts,
)
from model_infer_kvcache.analyzer.manifest import LayerPlan
from model_infer_kvcache.analyzer.operators.fa_facts import PAGED_MASK_LIMIT, PAGED_PSE_LIMIT

# Attributes transformers attention modules keep their softmax scale in (Falcon: inv_norm_factor).
SCALE_ATTRS = ("scaling", "softmax_scale", "inv_norm_factor")
_REL_TOL = 1e-9
CROSS_ATTENTION_NAMES = cross_kind.MODULE_NAMES  # a decoder block's attention over the encoder's states
# Configuration keys that would make transformers load remote code or are only bookkeeping.
_NOT_ARCH = ("model_type", "auto_map", "architectures", "transformers_version", "_name_or_path")


@dataclass(frozen=True)
class HfAttention:
    path: str
    cls: str | None  # None: the block has no attention module (linear / recurrent layer)
    scale: tuple[float, str] | None  # (value, attribute) or None when the module keeps none
    window: int | None  # sliding window the module applies (None: full)
    # (key head_dim, KV heads, value head dim) read from separate k_proj / v_proj and the module's head_dim; None
    # where the module has no such projections (fused qkv, MLA); value dim None without v_proj (K=V)
    kv_shape: tuple[int, int, int | None] | None = None
    sinks: bool = False  # the module holds learnable attention sinks
    # a recurrent mixer in the same decoder block beside the attention (Falcon-H1's Mamba2): its class name
    recurrent_beside: str | None = None
    # what the attention formats read off the module beyond the above (analyzer/kinds: each format's hf_facts), as
    # sorted (name, value) pairs: DeepSeek-V4's compressor rate and indexer top-k
    kind_facts: tuple[tuple[str, int | None], ...] = ()
    # the module attends to later positions too: the config flag under which the model is built as an encoder
    # (``encoder_flag``: is_decoder, causal), None when it attends causally
    bidirectional: str | None = None
    # a block without a recognised attention module that holds one kvcache cannot read (Reformer's LSHSelfAttention,
    # one query_key projection): its class and projections (``unread_attention``)
    unread: str | None = None
    # what the module's forward hands transformers' attention interface beyond what the plan and this check cover
    # (``score_terms``: "softcap", "position_bias", a rewritten mask): () for none; None when its forward never calls
    # the interface (it scores by itself: code kvcache has not read)
    score_terms: tuple[str, ...] | None = ()


def encoder_flag(model, config) -> str | None:
    """The config flag under which transformers built this causal-LM class as a bidirectional encoder (every position
    attends to later ones), None when it attends causally. Read from the built model's code and objects, not from a
    list of families:

    - ``is_decoder``: BERT-era ForCausalLM classes (Roberta, RemBert, BigBird...) attend causally only when
      ``config.is_decoder`` is true, and their own ``__init__`` says so ("add `is_decoder=True`");
    - ``causal``: XLM's model keeps ``config.causal`` (``XLMModel.causal``) and its ``get_masks`` builds the causal
      mask only when it is true: at false the LM head model is a masked LM over the whole sequence."""
    if getattr(config, "causal", None) is False and any(getattr(m, "causal", None) is False for m in model.modules()):
        return "causal"
    if getattr(config, "is_decoder", None) is not False:
        return None
    try:
        return "is_decoder" if "is_decoder=True" in inspect.getsource(type(model).__init__) else None
    except (OSError, TypeError):
        return None


@dataclass
class CheckResult:
    ships: bool | None  # None: transformers not installed
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked_layers: int = 0
    bidirectional: str | None = None  # refused as an encoder: the flag that makes it causal, the error's field
    # what kvcache cannot serve although the plan matches (a module calling the attention interface twice that is
    # not DiffLlama's differential pattern): not supported
    unsupported: list[str] = field(default_factory=list)
    # the compared attention modules whose score this check could not read whole (``score_terms``): "<class> at <path>:
    # <why>"; none, with layers compared, means every attention call of the model was read against the plan
    unread_scores: list[str] = field(default_factory=list)


def unread_score(mod: HfAttention, planned: frozenset[str] = frozenset()) -> str | None:
    """Why ``mod``'s score is not read whole (``score_terms`` beyond the terms its plan's format covers, ``planned``),
    as "<class> at <path>: <why>"; None when it is."""
    terms = None if mod.score_terms is None else [t for t in mod.score_terms if t not in planned]
    if terms == []:
        return None
    why = "its forward scores by itself (no call of transformers' attention interface)" if terms is None \
        else f"its attention call adds {', '.join(terms)}"
    return f"{mod.cls} at {mod.path}: {why}"


# The user cache of what transformers reports. KVCACHE_CACHE_DIR names its folder (set and empty: no cache);
# else $XDG_CACHE_HOME/model-infer-kvcache, else ~/.cache/model-infer-kvcache.
CACHE_ENV = "KVCACHE_CACHE_DIR"
CACHE_APP = "model-infer-kvcache"
CACHE_SUBDIR = "arch_check"
_CACHE_FORMAT = 35  # 2: K=V modules; 3: is_sliding / per-layer windows; 4: KV shape, sinks; 5: mixers; 6: mixed stacks; 7: multimodal text backbones built (were errors); 8: compress rate, index top-k; 9: pre-scaled queries; 10: the formats' module facts as pairs; 11: sets in error texts sorted; 12: Mamba mixer sizes; 13: a parallel mixer's sizes beside its attention; 14: bidirectional modules; 15: a KV-shared module's source layer (kv_source); 16: why a model has no KV cache (NoKvCacheArchitecture); 17: fused-QKV modules' KV heads, cross_attn modules; 18: attention calls per forward (attention_calls), GPT-Neo's unscaled _attn and local window_size; 22 (19-21: its drafts): JetMoE's experts + kv_proj read, its K/V tiled to the query heads (kv_tiled), query heads per module (query_heads), device-side reasons (position biases, LSH) in the diagnosis; 23: RWKV time-mix sizes (rwkv_facts), its stack found by its mixer; 24: xLSTM mLSTM layer sizes (mlstm_facts); 25: XLM's causal flag (encoder_flag) and q_lin / k_lin / v_lin; 26: gated delta nets' sizes and beta scale (gdn_facts), MiniMax's lightning attention. 27: RecurrentGemma's RG-LRU width and conv (rg_lru facts). 28: an MLA module's kv_lora_rank / qk_rope_head_dim (per-layer latent widths) and its own indexer (Dots3-Note). 29: ZAYA's CCA projection inside its attention (cca_facts). 30: a decoder of several stacks (HRM's L / H, loops_kind.stacks_of). 31: an error's raising transformers line (where_transformers_failed). 32: a QSA module's indexer head dim (Qwen4-Exp). 33: BLT's four stacks in its cache order (byte_patches.stacks_of). 34: DiffLlama's lambdas and group norm (differential). 35: the score terms of each module's attention call (score_terms). Bump when an entry's layout or what the live build reads changes


@dataclass(frozen=True)
class TransformersReport:
    """What the installed transformers says about one architecture section (the cached unit)."""

    ships: bool | None  # None: transformers not installed
    attentions: tuple[HfAttention, ...] | None = None  # None: not built (not shipped, or the build failed)
    error: str | None = None  # why the meta build failed ("TypeError: ...")


def transformers_ships(model_type: str) -> bool | None:
    """Whether the installed transformers implements ``model_type`` (None: transformers absent)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    return HF_MODEL_TYPE.get(model_type, model_type) in CONFIG_MAPPING


def hf_attentions(config: dict[str, Any], model_type: str) -> list[HfAttention]:
    """Build the model on the meta device and read each attention module's scale and window."""
    hf_type, section_json = _arch_key(config, model_type)
    return list(_hf_attentions(hf_type, section_json))


def _arch_key(config: dict[str, Any], model_type: str) -> tuple[str, str]:
    """(transformers model type, the architecture section as canonical JSON): all the meta build reads.

    The whole section, not a hand-picked list of attention fields: a field that looks irrelevant (a
    ``layer_types`` list, a rope dict, a flag read by one family) can change what transformers builds,
    and a key that misses one would let a cached answer outlive it.
    """
    section, _ = model_section(config)
    return (HF_MODEL_TYPE.get(model_type, model_type),
            json.dumps({k: v for k, v in section.items() if k not in _NOT_ARCH}, sort_keys=True))


def transformers_report(config: dict[str, Any], model_type: str) -> TransformersReport:
    """What transformers reports for this config, from the user cache when an entry for the installed
    transformers and this exact architecture section is there (and intact), else built and stored."""
    hf_type, section_json = _arch_key(config, model_type)
    identity = _installed_identity()
    if identity is None:  # transformers absent (or unreadable): nothing to key a cache entry by
        return _live_report(hf_type, section_json)[0]
    key = {"format": _CACHE_FORMAT, **identity, "model_type": hf_type, "config": section_json}
    path = _entry_path(key)
    cached = _load_entry(path, key) if path is not None else None
    if cached is not None:
        return cached
    report, keep = _live_report(hf_type, section_json)
    if path is not None and keep:
        _store_entry(path, key, report)
    return report


def encoder_positions(encoder: dict[str, Any], channels: int, side: list[int]) -> tuple[int | None, str]:
    """(positions, class name) of transformers' encoder for a composite config's ``encoder`` section run on the meta
    device over pixel_values [1, channels, *side] (analyzer/kinds/cross.py: the cross-attention's encoder length), or
    (None, why) where transformers cannot build or run it. Kept in the user cache like the reports (the import and the
    build cost seconds; the answer depends on the installed transformers and the section only)."""
    identity = _installed_identity()
    key = {"format": _CACHE_FORMAT, "fact": "encoder_positions", **(identity or {}),
           "config": json.dumps(encoder, sort_keys=True), "input": [channels, *side]}
    path = _entry_path(key) if identity is not None else None
    try:
        entry = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
        if entry is not None and entry["key"] == key and entry["sha256"] == _digest(entry["answer"]):
            return entry["answer"][0], entry["answer"][1]
    except Exception:  # noqa: BLE001 - a damaged entry: the live run answers instead
        pass
    answer, keep = _encoder_run(encoder, channels, side)
    if path is not None and keep:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"key": key, "answer": list(answer), "sha256": _digest(list(answer))},
                                               sort_keys=True))
        except (OSError, InputError):
            pass
    return answer


def _encoder_run(encoder: dict[str, Any], channels: int, side: list[int]) -> tuple[tuple[int | None, str], bool]:
    """(the answer, whether it may be kept: a machine's trouble is not the config's answer)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.for_model(encoder["model_type"], **{k: v for k, v in encoder.items() if k != "model_type"})
        with torch.device("meta"):
            model = AutoModel.from_config(config)
            out = model(pixel_values=torch.empty(1, channels, *side))
        return (int(out.last_hidden_state.shape[1]), type(model).__name__), True
    except Exception as exc:  # noqa: BLE001 - an encoder transformers cannot build or run derives nothing
        transient = isinstance(exc, (MemoryError, OSError, RecursionError, ImportError))
        return (None, f"{type(exc).__name__}: {_stable_text(' '.join(str(exc).split()))[:120]}"), not transient


def cache_dir() -> Path | None:
    """The cache folder (None: turned off with an empty KVCACHE_CACHE_DIR)."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return Path(named).expanduser() if named.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / CACHE_APP


def _installed_identity() -> dict[str, str] | None:
    """The installed transformers and torch (which builds the meta model), read without importing either."""
    if "transformers" in sys.modules and sys.modules["transformers"] is None:  # its import is blocked
        return None
    try:
        spec = importlib.util.find_spec("transformers")
        if spec is None:
            return None
        return {"transformers": importlib.metadata.version("transformers"),
                "transformers_at": str(spec.origin or list(spec.submodule_search_locations or [])),
                "torch": importlib.metadata.version("torch")}
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def _live_report(hf_type: str, section_json: str) -> tuple[TransformersReport, bool]:
    """(what transformers reports, whether that answer may be kept: a rejection of the config is the
    config's answer; a machine's trouble — memory, a file it could not read — is not)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return TransformersReport(ships=None), False
    if hf_type not in CONFIG_MAPPING:
        return TransformersReport(ships=False), True
    try:
        return TransformersReport(ships=True, attentions=_hf_attentions(hf_type, section_json)), True
    except Exception as exc:  # noqa: BLE001 - a config transformers rejects: the check is skipped, saying why
        limit = 1500 if isinstance(exc, NoKvCacheArchitecture) else 200  # the diagnosis is the refusal's reason
        first = _stable_text(str(exc).splitlines()[0])[:limit] if str(exc) else ""
        transient = isinstance(exc, (MemoryError, OSError, RecursionError))
        from model_infer_kvcache.analyzer.hf_models import where_transformers_failed

        # the transformers line that raised it: a bare KeyError names only the key it missed
        where = "" if isinstance(exc, NoKvCacheArchitecture) else where_transformers_failed(exc)
        return TransformersReport(ships=True, error=f"{type(exc).__name__}: {first}"
                                  + (f", raised at {where}" if where else "")), not transient


def _entry_path(key: dict[str, Any]) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    return folder / CACHE_SUBDIR / f"{_digest(key)}.json"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _payload(report: TransformersReport) -> dict[str, Any]:
    attentions = None if report.attentions is None else [
        [a.path, a.cls, None if a.scale is None else a.scale[0], None if a.scale is None else a.scale[1], a.window,
         None if a.kv_shape is None else list(a.kv_shape), a.sinks, a.recurrent_beside,
         [list(pair) for pair in a.kind_facts], a.bidirectional, a.unread,
         None if a.score_terms is None else list(a.score_terms)]
        for a in report.attentions]
    return {"ships": report.ships, "attentions": attentions, "error": report.error}


def _store_entry(path: Path, key: dict[str, Any], report: TransformersReport) -> None:
    """Write the entry atomically (analyzer.files); a cache that cannot be written is left as it was."""
    payload = _payload(report)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "report": payload, "sha256": _digest(payload)},
                                           sort_keys=True))
    except (OSError, InputError):
        pass


def _load_entry(path: Path, key: dict[str, Any]) -> TransformersReport | None:
    """The cached report, or None when the entry is missing, unreadable, for another key or damaged."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        payload = entry["report"]
        if entry["key"] != key or entry["sha256"] != _digest(payload):
            return None
        return _report_of(payload)
    except Exception:  # noqa: BLE001 - whatever is wrong with the entry, the live build answers instead
        return None


def _report_of(payload: dict[str, Any]) -> TransformersReport | None:
    ships, error, rows = payload["ships"], payload["error"], payload["attentions"]
    if ships not in (True, False) or not (error is None or isinstance(error, str)):
        return None
    if rows is None:
        return TransformersReport(ships=ships, error=error)
    out = []
    for path, cls, value, attr, window, kv_shape, sinks, beside, kind_facts, both_ways, unread, terms in rows:
        if not (isinstance(path, str) and (cls is None or isinstance(cls, str)) and _int_or_none(window)
                and ((value is None and attr is None)
                     or (isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(attr, str)))
                and (kv_shape is None or (isinstance(kv_shape, list) and len(kv_shape) == 3
                                          and all(_int_or_none(x) for x in kv_shape)))
                and isinstance(sinks, bool) and (beside is None or isinstance(beside, str))
                and isinstance(kind_facts, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                         and _int_or_none(p[1]) for p in kind_facts)
                and (both_ways is None or isinstance(both_ways, str)) and (unread is None or isinstance(unread, str))
                and (terms is None or (isinstance(terms, list) and all(isinstance(t, str) for t in terms)))):
            return None
        out.append(HfAttention(path, cls, None if value is None else (float(value), attr), window,
                               None if kv_shape is None else tuple(kv_shape), sinks, beside,
                               tuple(tuple(p) for p in kind_facts), both_ways, unread,
                               None if terms is None else tuple(terms)))
    return TransformersReport(ships=ships, attentions=tuple(out), error=error)


_SET_OF_STRINGS = re.compile(r"\{'[^'{}]*'(?:, '[^'{}]*')+\}")


def _stable_text(message: str) -> str:
    """An exception's text with each set of strings in sorted order: Python prints a set in an order that follows
    the process's hash seed (transformers' "Missing required keys ...: {'long_factor', 'short_factor'}"), and the
    text lands in the manifest, whose hash must not change from one run to the next."""
    return _SET_OF_STRINGS.sub(lambda m: "{" + ", ".join(sorted(m.group(0)[1:-1].split(", "))) + "}", message)


def _int_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


@functools.lru_cache(maxsize=32)
def _hf_attentions(hf_type: str, section_json: str) -> tuple[HfAttention, ...]:
    import torch
    from model_infer_kvcache.analyzer.hf_layout import LayoutError, attention_modules, find_decoder_stack
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from transformers import AutoConfig

    config = AutoConfig.for_model(hf_type, **json.loads(section_json))
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = causal_lm_from_config(config)
    out = []
    try:
        section = json.loads(section_json)
        stack = find_decoder_stack(model, loops_kind.stacks_of(section) or byte_patches_kind.stacks_of(section))
    except LayoutError as exc:
        raise NoKvCacheArchitecture(why_no_kv_cache(model, config) or str(exc)) from None
    found = attention_modules(model, stack)
    mixers = [recurrent_mixer_module(block) for block in stack.layers]

    def mixer_module(path: str):  # the mixer of the block a path lies in ("<stack>.<i>[.<attention>]")
        return mixers[int(path[len(stack.path) + 1:].split(".")[0])]

    def mixer_of(path: str) -> str | None:
        mixer = mixer_module(path)
        return None if mixer is None else type(mixer).__name__
    # classes that set sliding_window on their sliding layers only (Qwen2-MoE): where it is missing, no window
    per_layer = {type(module) for _, module in found if module is not None and hasattr(module, "sliding_window")}
    encoder = encoder_flag(model, config)
    for path, module in found:
        if module is None:  # a block without attention: the recurrent mixer it holds, if any (Bamba's BambaMixer)
            # with its sizes, which the planned state must match (analyzer/linear_config.mixer_facts)
            mixer = mixer_module(path)
            out.append(HfAttention(path, None, None, None, recurrent_beside=mixer_of(path),
                                   kind_facts=tuple(sorted(mixer_facts(mixer).items())) if mixer is not None else (),
                                   unread=None if mixer is not None else _unread_block(
                                       stack.layers[int(path[len(stack.path) + 1:].split(".")[0])])))
            continue
        scale = _prescaled(module) or _divided_queries(module) or next(
            ((float(getattr(module, a)), a) for a in SCALE_ATTRS
             if isinstance(getattr(module, a, None), (int, float)) and not isinstance(getattr(module, a), bool)), None)
        window = None if type(module) in per_layer and not hasattr(module, "sliding_window") \
            else _window_of(module, config)
        # a mixer beside the attention (Falcon-H1): its sizes ride along, for a parallel hybrid's planned state
        beside = mixer_module(path)
        module_facts = dict(hf_module_facts(module)) | (mixer_facts(beside) if beside is not None else {}) \
            | _kv_source(module, config) | _attention_calls(module) | _kv_tiled(module) | _query_heads(module)
        out.append(HfAttention(path, type(module).__name__, scale, window, _kv_shape(module),
                               getattr(module, "sinks", None) is not None, mixer_of(path),
                               tuple(sorted(module_facts.items())), encoder, score_terms=score_terms(module)))
    return tuple(out)


class NoKvCacheArchitecture(LookupError):
    """transformers' causal LM holds no decoder block with an attention module kvcache recognises, and its own code
    says why (``why_no_kv_cache``)."""


_SOFTMAX_CALL = re.compile(r"softmax\(|ALL_ATTENTION_FUNCTIONS|scaled_dot_product_attention")


def why_no_kv_cache(model, config) -> str | None:
    """Why a causal LM that holds no attention module kvcache recognises keeps no KV cache it could plan, read from
    transformers' own objects (None when none of these facts holds: the caller says so generically):

    - its modeling file calls no softmax and no attention interface (RWKV, xLSTM): a recurrence whose per-request
      state is no cache of past keys and values;
    - a module with Transformer-XL relative-position biases (``r_w_bias`` / ``r_r_bias``, XLNet): its keys are
      scored against relative-position embeddings and what it caches are the layers' input hidden states (``mems``);
    - an attention module adding a position bias to its scores (CPM-Ant, ProphetNet: ``position_biased_attention``),
      which the paged FA call cannot take (``fa_facts.PAGED_PSE_LIMIT``, with its op doc lines);
    - an attention module whose projections are none kvcache reads (a shared ``query_key``, per-expert ``experts``):
      named with its projections."""
    name = type(model).__name__
    source = _module_text(model)
    if source is not None and not _SOFTMAX_CALL.search(source):
        blocks = sorted({type(b).__name__ for m in model.modules() if isinstance(m, _module_list_type()) for b in m})
        return (f"{_source_of(model)} calls no softmax and no attention interface: {name} is a recurrence "
                f"({', '.join(blocks[:2]) or 'its blocks'}) whose per-request state is not a cache of past keys and "
                "values (no attention, so nothing for a KV cache or FA to serve)")
    for module in model.modules():
        params = {p for p, _ in module.named_parameters(recurse=False)}
        if {"r_w_bias", "r_r_bias"} <= params:
            mem = getattr(config, "mem_len", None)
            return (f"{type(module).__name__} ({_source_of(model)}) is Transformer-XL relative attention: its scores add "
                    "relative-position terms (r_w_bias, r_r_bias over relative-position embeddings) and what it "
                    f"caches between steps are each layer's input hidden states (mems, config mem_len {mem}), from "
                    "which keys and values are recomputed: no cache of keys and values kvcache could plan; its "
                    f"position term is a bias on every query-key score, and {PAGED_PSE_LIMIT}")
    biased = position_biased_attention(model)
    if biased is not None:
        return f"{biased} ({_source_of(model)}): {PAGED_PSE_LIMIT}"
    unread = unread_attention(model)
    if unread is not None:
        return (f"its attention {unread} ({_source_of(model)}), none of the query / key / value projection sets "
                "kvcache reads, so its cache shape cannot be checked against the plan nor its render validated (not "
                "supported by kvcache yet)")
    return None


def position_biased_attention(model) -> str | None:
    """An attention module kvcache does not read whose scores add a position bias, said from transformers' own code
    (None without one): a forward adding the ``position_bias`` it is handed (CPM-Ant: ``score + position_bias``, from
    its segment / bucketed relative-position embedding) or logits from a child named ``relative*`` (ProphetNet's
    ``relative_pos_embeddings``: a Linear from each query's hidden state to a logit per distance bucket and head)."""
    from model_infer_kvcache.analyzer.hf_layout import is_attention
    from torch import nn

    for sub in model.modules():
        cls = type(sub).__name__
        if not cls.endswith("Attention") or is_attention(sub):
            continue
        try:
            source = inspect.getsource(type(sub).forward)
        except (OSError, TypeError):
            continue
        if "position_bias" in inspect.signature(type(sub).forward).parameters and "+ position_bias" in source:
            makers = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("position_bias")})
            made = f" (computed by {', '.join(makers)})" if makers else ""
            return f"{cls} adds the position_bias it is handed{made} to every query-key score"
        code = inspect.getsource(type(sub))
        relative = [(n, c) for n, c in sub.named_children() if n.startswith("relative") and f"self.{n}" in code]
        if relative:
            name, child = relative[0]
            how = "computed from each query's hidden state by a Linear" if isinstance(child, nn.Linear) else \
                f"a {type(child).__name__}"
            return f"{cls} adds relative-position logits to every query-key score ({name}: {how})"
    return None


def lsh_attention(module) -> str | None:
    """Why a locality-sensitive-hashing attention (Reformer's LSHSelfAttention: ``_hash_vectors``) keeps no paged KV
    cache, from its own objects; None for any other module."""
    if not callable(getattr(module, "_hash_vectors", None)):
        return None
    return (f"{type(module).__name__} attends each query to the keys of its own hash bucket(s) only (_hash_vectors: "
            f"{getattr(module, 'num_hashes', '?')} hash round(s), keys sorted by bucket into chunks of "
            f"{getattr(module, 'chunk_length', '?')} with {getattr(module, 'num_chunks_before', '?')} chunk(s) "
            "before), and its cache keeps each layer's hidden states and buckets (ReformerDynamicCache states_cache / "
            f"buckets_cache), not keys and values; {PAGED_MASK_LIMIT}")


def _unread_block(block) -> str | None:
    """What a decoder block without a recognised attention holds: why its LSH attention keeps no paged KV cache, else
    its attention module with the projections kvcache does not read."""
    return next((why for m in block.modules() if (why := lsh_attention(m))), None) or unread_attention(block)


def unread_attention(module) -> str | None:
    """The first submodule whose class names itself an attention (``...Attention``), owns linear projections and
    none of the projection sets kvcache reads (analyzer/hf_layout.QKV_PROJECTIONS), as "<class> projecting through <its
    children>"; None without one."""
    from model_infer_kvcache.analyzer.hf_layout import is_attention
    from torch import nn

    for sub in module.modules():
        cls = type(sub).__name__
        if cls.endswith("Attention") and not is_attention(sub) and any(isinstance(c, nn.Linear) for c in sub.children()):
            children = ", ".join(sorted(n for n, c in sub.named_children() if not isinstance(c, (nn.Dropout,
                                                                                           nn.Softmax)))[:6])
            return f"{cls}{UNREAD_MARK}{children}"
    return None


UNREAD_MARK = " projecting through "  # unread_attention's text: projections kvcache does not read


def why_no_kv_cache_of(config: dict[str, Any]) -> str | None:
    """``why_no_kv_cache`` for a config file's content, through the cached report of what transformers builds (None:
    transformers absent, not shipping the type, building it otherwise, or giving no reason)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not transformers_ships(model_type):
        return None
    report = transformers_report(config, model_type)
    head = f"{NoKvCacheArchitecture.__name__}: "
    if report.error is None or not report.error.startswith(head) or "no nn.ModuleList of decoder blocks" in report.error:
        return None
    return (f"transformers builds {model_type!r} with no decoder block holding an attention module kvcache "
            f"recognises: {report.error[len(head):]}")


def why_layer_type(config: dict[str, Any], index: int, layer_type: str) -> str | None:
    """What transformers' decoder block ``index`` holds, for a config layer type kvcache has no kind for ("hybrid"
    in Zamba, Inkling, ZAYA: three different things): its attention module(s) and the per-request states beside them
    (a causal Conv1d keeps a conv state while decoding; a Mamba mixer its recurrent state), and a relative-position
    module on the attention's logits. None when transformers is absent, does not ship the type, cannot build the
    config or shows neither an attention nor a state there."""
    from model_infer_kvcache.analyzer.hf_layout import LayoutError, find_attentions, find_decoder_stack
    from torch import nn

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not transformers_ships(model_type):
        return None
    try:
        model = _meta_model(*_arch_key(config, model_type))
        block = find_decoder_stack(model).layers[index]
    except (LayoutError, IndexError, Exception):  # noqa: BLE001 - no build, no reason to give: the caller's own
        return None
    attentions = find_attentions(block)
    states = sorted({type(parent).__name__ for parent in block.modules() for child in parent.children()
                     if isinstance(child, nn.Conv1d)} | ({recurrent_mixer(block)} - {None}))
    if not attentions or not states:
        return None
    names = ", ".join(type(m).__name__ for _, m in attentions)
    relative = sorted({type(sub).__name__ for _, m in attentions for sub in m.modules() if "Relative" in
                       type(sub).__name__})
    held = (f"layer type {layer_type!r}: transformers' {type(block).__name__} (decoder block {index}, "
            f"{_source_of(model)}) holds {names} with per-request state beside its KV cache ({', '.join(states)}: "
            "a causal convolution's conv state or a recurrent state carried from token to token)")
    if relative:
        # the device-side reason first: planning the states would still leave the logits' bias without a paged FA
        return (f"{held}, and {relative[0]} adds a position bias computed per query to its logits: "
                f"{PAGED_PSE_LIMIT}")
    return (f"{held}; kvcache plans a state only for a layer without attention, or beside one for Falcon-H1's "
            "parallel Mamba-2 mixer, Zamba's / Zamba2's hybrid layer and ZAYA's CCA projection (model types whose "
            "layer types it reads so), so this layer's states would be dropped")


def _meta_model(hf_type: str, section_json: str):
    """transformers' causal LM for this architecture section, built on the meta device (eager attention)."""
    import torch
    from model_infer_kvcache.analyzer.hf_models import causal_lm_from_config
    from transformers import AutoConfig

    config = AutoConfig.for_model(hf_type, **json.loads(section_json))
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return causal_lm_from_config(config)


def _module_list_type():
    from torch import nn

    return nn.ModuleList


def _source_of(model) -> str:
    """The transformers file a model's class is defined in, from the package on (``transformers/models/x/...``)."""
    module = type(model).__module__
    return module.replace(".", "/") + ".py" if module.startswith("transformers.") else module


def _module_text(model) -> str | None:
    """The code of the model's modeling file, without docstrings' prose mattering (a call is what is looked for)."""
    try:
        return inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return None


KV_SOURCE_FACT = "kv_source"
CALLS_FACT = "attention_calls"


def _attention_calls(module) -> dict[str, int]:
    """{CALLS_FACT: n} on a module whose forward calls transformers' attention interface n > 1 times on every call
    (statements outside any branch: a vision tower's ``if`` / ``else`` between two backends is one call). DiffLlama's
    differential attention calls it twice over the same K with two regroupings of V made after the cache update:
    ``softmax(Q K^T) V1 - lambda * softmax(Q K^T) V2``, each query head reading value heads other than its key
    head's. A host that caches inside the interface overwrites the first call's V rows with the second's. Served
    when the module is DiffLlama's (``_differential_planned``); refused otherwise."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    calls = sum(1 for stmt in body if not isinstance(stmt, (ast.If, ast.For, ast.While, ast.Try, ast.With))
                for node in ast.walk(stmt) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "attention_interface")
    return {CALLS_FACT: calls} if calls > 1 else {}


# Arguments of transformers' attention interface that add nothing to a score kvcache does not plan or this check does
# not compare: the scale (``scaling``: the module's attribute, compared), the window (compared), the sinks (``s_aux`` /
# ``sinks``: compared), dropout (off at inference), the causal mask as the model built it, and the varlen / flash
# plumbing. Any other argument (``softcap``, ``position_bias``, a selection's ``indices``) is a score term.
_PLAIN_CALL_ARGS = frozenset({"scaling", "sliding_window", "s_aux", "sinks", "dropout", "attention_mask", "is_causal",
                              "position_ids", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                              "max_length_k", "query", "key", "value"})


def score_terms(module) -> tuple[str, ...] | None:
    """The score terms the module's forward hands transformers' attention interface (``attention_interface(...)``)
    beyond ``_PLAIN_CALL_ARGS``, sorted, plus ``MASK_REWRITTEN`` where the forward assigns its ``attention_mask`` (a
    bias folded into the mask: ALiBi's way); None where the forward never calls the interface (it scores by itself)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "attention_interface"]
    if not calls:
        return None
    terms = {kw.arg for call in calls for kw in call.keywords if kw.arg is not None and kw.arg not in _PLAIN_CALL_ARGS}
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    if any(isinstance(t, ast.Name) and t.id == "attention_mask" for t in targets):
        terms.add(MASK_REWRITTEN)
    return tuple(sorted(terms))


TILED_FACT = "kv_tiled"
QUERY_FACT = "query_heads"


def _query_heads(module) -> dict[str, int]:
    """{QUERY_FACT: n}: the query heads the module attends with. A module tiling its K/V to its query heads (JetMoE)
    has as many as its tiled K/V: tiles x KV heads (its ``num_heads`` is the config's, which its forward never
    reads); any other, where it keeps them (``num_heads`` / ``num_attention_heads``)."""
    tiles, shape = _kv_tiled(module).get(TILED_FACT), _kv_shape(module)
    if tiles is not None and shape is not None:
        return {QUERY_FACT: tiles * shape[1]}
    n = next((getattr(module, a) for a in ("num_heads", "num_attention_heads") if isinstance(getattr(module, a, None),
                                                                                          int)), None)
    return {QUERY_FACT: n} if isinstance(n, int) and not isinstance(n, bool) and n > 0 else {}


def _kv_tiled(module) -> dict[str, int]:
    """{TILED_FACT: r} on a module whose forward tiles its K/V to its query heads (JetMoE: ``key_states.repeat(1,
    self.top_k, 1, 1)``, r = top_k): query head e x KV heads + h reads KV head h, where FA's GQA pairs query head j
    with KV head j // (query heads / KV heads)."""
    match = re.search(r"key_states\.repeat\(1, self\.(\w+), 1, 1\)", _forward_text(module))
    r = getattr(module, match.group(1), None) if match else None
    return {TILED_FACT: r} if isinstance(r, int) and not isinstance(r, bool) and r > 1 else {}


def _forward_text(module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _kv_source(module, config) -> dict[str, int]:
    """{KV_SOURCE_FACT: j} on a KV-shared module (``is_kv_shared_layer``): the layer whose K/V it reads, by
    transformers' own rule (the config's ``kv_sharing_modes``: the "store" layer of the module's ``layer_type``)."""
    if getattr(module, "is_kv_shared_layer", False) is not True:
        return {}
    modes, types = getattr(config, "kv_sharing_modes", None), getattr(config, "layer_types", None)
    kind = getattr(module, "layer_type", None)
    stores = [j for j, mode in enumerate(modes or []) if mode == "store" and types and types[j] == kind]
    return {KV_SOURCE_FACT: stores[-1] if stores else -1}


def _prescaled(module) -> tuple[float, str] | None:
    """(1.0, why) for a module that scales its queries itself and calls attention with ``scaling=1.0`` (OPT: the
    scale of the attention call over its queries is 1, not its ``scaling`` attribute), else None."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    if "scaling=1.0" in source and "* self.scaling" in source:
        return 1.0, "scaling=1.0 in its attention call (queries pre-scaled by self.scaling)"
    return unscaled_scores(module)


_DIVIDED_QUERIES = re.compile(r"\bq\s*=\s*q\s*/\s*math\.sqrt\(self\.head_dim\)")


def _divided_queries(module) -> tuple[float, str] | None:
    """(head_dim^-0.5, why) for a module that divides its queries by sqrt(head_dim) before scoring them itself and
    keeps no scale attribute (XLM's MultiHeadAttention: ``q = q / math.sqrt(self.head_dim)``), else None."""
    if any(hasattr(module, a) for a in SCALE_ATTRS) or not isinstance(getattr(module, "head_dim", None), int):
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    if _DIVIDED_QUERIES.search(source):
        return module.head_dim ** -0.5, "q / math.sqrt(self.head_dim) in its forward"
    return None


def unscaled_scores(module) -> tuple[float, str] | None:
    """(1.0, why) for a module scoring by itself in ``_attn`` with no scale at all (GPT-Neo: ``torch.matmul(query,
    key.transpose(-1, -2))``, no 1/sqrt(head_dim), no scale attribute), else None."""
    if any(hasattr(module, a) for a in SCALE_ATTRS) or not callable(getattr(module, "_attn", None)):
        return None
    try:
        code = [line.split("#", 1)[0] for line in inspect.getsource(type(module)._attn).splitlines()[1:]]
    except (OSError, TypeError):
        return None
    body = "\n".join(code)
    if "torch.matmul(" in body and not any(w in body for w in ("scal", "sqrt", "norm_factor", "/", "alpha")):
        return 1.0, "_attn (scores q k^T unscaled)"
    return None


def recurrent_mixer(block) -> str | None:
    """Class name of a recurrent (state-space / linear-attention) mixer inside a decoder block, outside its attention
    modules: a module owning ``A_log`` or ``dt_bias`` (Mamba / Mamba2 / gated delta net), None without one."""
    mixer = recurrent_mixer_module(block)
    return None if mixer is None else type(mixer).__name__


def recurrent_mixer_module(block):
    """The recurrent mixer module of ``recurrent_mixer``, None without one; a CCA projection (ZAYA's
    ZayaCCAProjection) inside the attention module counts: its states sit beside the attention's KV cache."""
    from model_infer_kvcache.analyzer.hf_layout import find_attentions

    skip = [name for name, _ in find_attentions(block)]
    for name, module in block.named_modules():
        if cca_facts(module):
            return module
        if any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        if any(p in ("A_log", "dt_bias") for p, _ in module.named_parameters(recurse=False)):
            return module
        if short_conv_facts(module):  # LFM2's gated short conv: no A_log, a depthwise conv beside in/out_proj
            return module
        if rwkv_facts(module):  # RWKV-4's time-mix: time_decay / time_first, no A_log
            return module
        if mlstm_facts(module):  # xLSTM's mLSTM layer: its backend, no A_log
            return module
        if rg_lru_facts(module):  # RecurrentGemma's recurrent block: conv_1d + rg_lru, no A_log
            return module
    return None


def _kv_shape(module) -> tuple[int, int, int | None] | None:
    """(key head_dim, KV heads, value head dim) from the module's own k_proj / v_proj and head_dim (MiMo-V2-Flash:
    192 / 128 and twice the KV heads on its sliding layers), None where it keeps no such projections."""
    from torch import nn

    k, v, d = getattr(module, "k_proj", None), getattr(module, "v_proj", None), getattr(module, "head_dim", None)
    if not isinstance(k, nn.Linear):
        # a fused QKV projection (DBRX's Wqkv, Phi-3's qkv_proj) sizes K/V by the module's own head count: the KV
        # heads it reshapes into, read where it keeps them (the value dim is its head_dim there)
        kv = getattr(module, "num_key_value_heads", None)
        if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 and isinstance(d, int) and d > 0:
            return d, kv, None
        return None
    if not (isinstance(d, int) and d > 0 and k.out_features % d == 0):
        return None
    kv = k.out_features // d
    vd = v.out_features // kv if isinstance(v, nn.Linear) and v.out_features % kv == 0 else None
    return d, kv, vd


def _window_of(module, config) -> int | None:
    """The window transformers applies on this module's layer.

    A module's own ``sliding_window`` attribute is per layer (Qwen2/3, Gemma, gpt-oss), unless the module says it
    is not sliding (``is_sliding`` False); a class that sets it on some layers only applies none on the others
    (the caller decides that, seeing every layer). Otherwise,
    when the modeling file uses sliding windows at all (Mistral, Phi-3, PhiMoE pass
    ``config.sliding_window`` to the attention call or build the model's mask with it), the
    config's window applies to every layer; a modeling file that never mentions one applies none.
    """
    if getattr(module, "attention_type", None) in ("local", "global") and \
            isinstance(getattr(config, "window_size", None), int):  # GPT-Neo: its local layers' window_size
        return config.window_size if module.attention_type == "local" else None
    if hasattr(module, "sliding_window"):
        # Kolibri1 keeps the config's window on every layer and applies it where ``is_sliding`` (its full layers
        # pass sliding_window=None to the attention call)
        return None if getattr(module, "is_sliding", None) is False else module.sliding_window
    try:
        source = inspect.getsource(inspect.getmodule(type(module)))
    except (OSError, TypeError):
        return None
    if "sliding_window" in source:
        return getattr(getattr(module, "config", config), "sliding_window", None)
    return None


def _encoder_error(config: dict[str, Any], model_type: str, first: HfAttention) -> str:
    """The refusal of a causal-LM class transformers built as a bidirectional encoder, naming the config flag that
    makes it causal (``encoder_flag``), the modeling file and what this family's causal LM sets."""
    source = _source_of(_meta_model(*_arch_key(config, model_type)))
    where = f"{first.cls} at {first.path} attends to later positions, {source}"
    if first.bidirectional == "causal":
        # XLM: XLMWithLMHeadModel is a masked LM at causal false (XLMConfig's default); its CLM checkpoints
        # (xlm-clm-enfr-1024, xlm-clm-ende-1024) set causal: true, which kvcache plans
        return (f"config causal is false: transformers builds {model_type!r} as a bidirectional masked LM (its model "
                f"applies the causal mask only with causal true, get_masks; {where}), which no KV cache can serve; "
                "its causal LM (the CLM checkpoints) sets causal: true in its config, which kvcache plans")
    # BERT-era families build their ForCausalLM as an encoder unless is_decoder is true: every position attends
    # to later ones, so no cache of past keys can reproduce it (transformers itself warns "add is_decoder=True")
    return (f"is_decoder is false: transformers builds {model_type!r} as a bidirectional encoder (its causal-LM class "
            f"attends causally only with is_decoder=True; {where}), which no KV cache can serve; a causal LM of this "
            "family sets is_decoder: true in its config")


def is_linear_module(cls: str | None) -> bool:
    """A transformers module class of a linear-attention layer (a recurrent state, no softmax over keys)."""
    return bool(cls) and cls.endswith(LINEAR_MODULE_SUFFIXES)


def byte_patch_problems(config: dict[str, Any]) -> list[str]:
    """A BLT config's planned cache layers against transformers' own modules (byte_patches.module_problems, on the
    meta build that joins its stacks in cache order); nothing where transformers cannot build it."""
    report = transformers_report(config, str(config.get("model_type")))
    if not report.ships or report.attentions is None:
        return []
    return byte_patches_kind.module_problems(byte_patches_kind.read_facts(config, "config"), report.attentions)


def cross_check(config: dict[str, Any], facts: ModelFacts, layers: list[LayerPlan], scale: float,
                scale_txt: str, attn_tp_size: int = 1, legacy: bool = False) -> CheckResult:
    """Compare the planned scale, per-layer window, KV cache shape (per rank) and sinks with the architecture's
    attention modules."""
    lin = facts.linear.value
    if kvcache_reference(lin):
        # Ling-2.5 publishes model_type bailing_hybrid, which transformers implements as another architecture
        # (Ling-3.0 KDA): building it would compare against the wrong model.
        return CheckResult(ships=False, notes=[
            f"architecture cross-check skipped: transformers implements no {lin.family} model ({lin.source}); "
            f"its model_type {facts.model_type!r} in transformers is another architecture"])
    report = transformers_report(config, facts.model_type)
    result = CheckResult(ships=report.ships)
    if not report.ships:
        return result
    if report.attentions is None and (report.error or "").startswith(f"{NoKvCacheArchitecture.__name__}: ") \
            and "no nn.ModuleList of decoder blocks" not in report.error:
        # built, and transformers' own code says why no block holds an attention kvcache could cache (a recurrence, a
        # bidirectional masked LM, relative attention over cached hidden states): that reason, with its source; one
        # resting on the paged FA call's limits (a score bias) is kvcache's refusal, not a bad input
        why = why_no_kv_cache_of(config) or report.error
        (result.unsupported if PAGED_PSE_LIMIT in why else result.errors).append(why)
        return result
    if report.attentions is None and (report.error or "").split(": ", 1)[0] in ("LayoutError",
                                                                                NoKvCacheArchitecture.__name__) \
            and "no nn.ModuleList of decoder blocks holding an attention module" in report.error:
        # Built, and no decoder block holds an attention module kvcache recognises: either none attends (xLSTM,
        # Mamba2: an attention plan would be silently wrong) or its projections have names the host cannot route
        # (CTRL, XLNet: validation could not run it either). Either way the plan is unchecked: refused.
        result.errors.append(f"analyzer plans attention on {len(layers)} layer(s); transformers builds "
                             f"{facts.model_type!r} with no decoder block holding an attention module kvcache "
                             f"recognises ({report.error.split(': ', 1)[1].split(' (')[0]}): a model without "
                             "attention (xLSTM, Mamba2) or with projections named otherwise; the plan cannot be "
                             "checked or validated")
        return result
    if report.attentions is None and "is_decoder=True" in (report.error or ""):
        # Reformer's LM head refuses to build at all without is_decoder (an AssertionError saying so)
        result.errors.append(f"is_decoder is false: transformers refuses to build {facts.model_type!r} as a causal LM "
                             f"without it ({report.error}); a causal LM of this family sets is_decoder: true")
        result.bidirectional = "is_decoder"
        return result
    if report.attentions is None:
        result.notes.append(f"architecture cross-check skipped: transformers could not build {facts.model_type!r} "
                            f"on the meta device ({report.error})")
        return result
    hf = report.attentions
    attending = [a for a in hf if a.cls is not None]
    if attending and all(a.bidirectional for a in attending):
        result.errors.append(_encoder_error(config, facts.model_type, attending[0]))
        result.bidirectional = attending[0].bidirectional
        return result
    # a parallel hybrid (Falcon-H1) or a Zamba2 hybrid layer plans its mixer state as a second sublayer beside the
    # attention: transformers' modules line up with the first sublayers, and each one's mixer beside it with the state
    # planned for that layer (a Zamba2 Mamba layer, one sublayer, lines up with its block's mixer)
    states_of = {layer.decoder_layer for layer in layers if layer.is_state and layer.sublayer}
    layers = [layer for layer in layers if not (layer.is_state and layer.sublayer)]
    uncached = [i for i, kind in enumerate(facts.layer_kinds.value) if kind == NO_CACHE]
    if uncached:
        # blocks planned without any cache (Nemotron-H's MLP / MoE blocks): transformers' block there must hold
        # neither attention nor a recurrent mixer; the cache layers line up with the other blocks
        if len(hf) != len(facts.layer_kinds.value):
            result.errors.append(f"decoder blocks: analyzer reads {len(facts.layer_kinds.value)} "
                                 f"({facts.layer_kinds.source}), transformers builds {len(hf)}")
            return result
        # Mllama: a cross-attention-only block (planned in the cross_attention section) holds its cross module
        only = set(getattr(facts.cross.value, "only_layers", None) or ())
        cross_only = [hf[i] for i in uncached if i in only and hf[i].path.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES]
        cached_off = [(i, hf[i]) for i in uncached
                      if (hf[i].cls is not None or hf[i].recurrent_beside) and hf[i] not in cross_only]
        if cached_off:
            i, mod = cached_off[0]
            result.errors.append(f"analyzer plans no cache on {len(cached_off)} block(s) where transformers' block "
                                 f"holds {mod.cls or mod.recurrent_beside}, first block {i} at {mod.path} "
                                 f"({facts.layer_kinds.source})")
            return result
        hf = [mod for i, mod in enumerate(hf) if i not in set(uncached)]
    else:
        cross_only = []
    cross = [a for a in hf if a.path.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES]
    if cross_only and not cross:
        # Mllama's cross-attention-only blocks over the vision states (analyzer/kinds/cross.py: only_layers)
        problems = cross_kind.hf_problems(facts, cross_only, scale)
        if problems:
            result.errors += problems
            return result
        result.unread_scores += [why for mod in cross_only if (why := unread_score(mod)) is not None]
        result.notes.append(f"cross-attention checked: {len(cross_only)} {cross_only[0].cls} module(s) (blocks "
                            f"{list(facts.cross.value.only_layers)}, K/V heads, head_dim, scale) match the "
                            "cross_attention plan")
    elif cross and len(hf) - len(cross) == len(layers):
        # the decoder of an encoder-decoder family (BART / Whisper / TrOCR ForCausalLM): each block also attends over
        # the encoder's states, planned as the cross_attention section (analyzer/kinds/cross.py); the self-attention
        # modules are compared with the layers below
        problems = cross_kind.hf_problems(facts, cross, scale)
        if problems:
            result.errors += problems
            return result
        result.unread_scores += [why for mod in cross if (why := unread_score(mod)) is not None]
        hf = tuple(a for a in hf if a not in cross)
        result.notes.append(f"cross-attention checked: {len(cross)} {cross[0].cls} module(s) at "
                            f"{cross[0].path.rsplit('.', 3)[0]}.*.{cross[0].path.rsplit('.', 1)[-1]} (K/V heads, "
                            "head_dim, scale) match the cross_attention plan")
    elif cross:
        # blocks that attend over another model's states instead of their own tokens (Mllama's
        # MllamaCrossAttentionDecoderLayer over the vision encoder, config cross_attention_layers): a self-attention
        # KV cache planned there would be sized for tokens the block never caches
        result.errors.append(f"transformers' {facts.model_type!r} decoder holds {len(cross)} block(s) whose attention "
                             f"is over another model's states ({cross[0].cls} at {cross[0].path}), not beside a "
                             "self-attention: the analyzer plans a self-attention KV cache there (not supported by "
                             "kvcache: cross-attention-only layers interleaved with self-attention layers)")
        return result
    elif facts.cross.value is not None:
        result.errors.append(f"analyzer plans cross-attention ({facts.cross.source}) and transformers' "
                             f"{facts.model_type!r} decoder blocks hold no cross-attention module")
        return result
    if (loops := facts.loops.value) is not None:
        # Dory per_loop, HRM's cycles: a layer's later calls are cache layers of the module compared below, planned
        # as its layer (the manifest's invariant, analyzer/kinds/loops.py): transformers builds one module per layer
        first = {d: i for i, d in reversed(list(enumerate(loops.calls)))}
        layers = [layers[first[d]] for d in sorted(first)]
    if len(hf) != len(layers):
        result.errors.append(f"attention layers: analyzer plans {len(layers)}, transformers builds {len(hf)}")
        return result
    max_pos = facts.max_position_embeddings.value
    scale_off: list[tuple[LayerPlan, HfAttention]] = []
    window_off: list[tuple[LayerPlan, HfAttention, int | None]] = []
    kv_off: list[tuple[LayerPlan, HfAttention, tuple, tuple]] = []
    sinks_off: list[tuple[LayerPlan, HfAttention]] = []
    fmt = format_of(facts)
    format_off: list[tuple[LayerPlan, HfAttention, str]] = []
    beside_off: list[tuple[LayerPlan, HfAttention]] = []
    no_attention: list[tuple[LayerPlan, HfAttention]] = []
    state_off: list[tuple[LayerPlan, HfAttention, str]] = []
    source_off: list[tuple[LayerPlan, HfAttention, int | None]] = []
    calls_off: list[tuple[LayerPlan, HfAttention, int]] = []
    tiled: list[tuple[LayerPlan, HfAttention, int]] = []
    queries_off: list[tuple[LayerPlan, HfAttention, int, str]] = []
    all_layers = layers
    for layer, mod in zip(layers, hf, strict=True):
        if mod.cls is None:
            if not layer.is_recurrent:
                no_attention.append((layer, mod))
            elif lin is not None and (off := mixer_off(lin, dict(mod.kind_facts))):
                state_off.append((layer, mod, off))
            continue
        result.checked_layers += 1
        if layer.is_recurrent != is_linear_module(mod.cls):
            planned = "linear attention" if layer.is_recurrent else layer.attn_type
            result.errors.append(f"layer {layer.index}: analyzer plans {planned}, transformers has "
                                 f"{mod.cls} at {mod.path}")
            continue
        if layer.is_recurrent:  # a linear module found by its q/k/v projections (OLMo-Hybrid's): its sizes too
            if lin is not None and (off := mixer_off(lin, dict(mod.kind_facts))):
                state_off.append((layer, mod, off))
            continue
        if (unread := unread_score(mod, fmt.planned_score_terms)) is not None:
            result.unread_scores.append(unread)
        if mod.recurrent_beside and layer.decoder_layer not in states_of:
            beside_off.append((layer, mod))
            continue
        if mod.recurrent_beside and (off := mixer_off(lin, dict(mod.kind_facts))):
            state_off.append((layer, mod, off))
        # a layer planned with its own scale (per_layer_config's MLA shape) is held to it
        if mod.scale is not None and not math.isclose(mod.scale[0], layer.softmax_scale or scale, rel_tol=_REL_TOL):
            scale_off.append((layer, mod))
        # a window of 0 is off (Qwen2-MoE's config writes 0 when use_sliding_window is false)
        hf_window = mod.window if mod.window and (max_pos is None or mod.window < max_pos) else None
        if hf_window != layer.sliding_window:
            window_off.append((layer, mod, hf_window))
        shape = _planned_kv_shape(layer)
        if layer.kv_source_layer is not None and 0 <= layer.kv_source_layer < len(hf):
            # a KV-shared layer's cache is its source's: the source module's k_proj / v_proj and the source's plan
            shape, mod_kv = _planned_kv_shape(all_layers[layer.kv_source_layer]), hf[layer.kv_source_layer].kv_shape
        else:
            mod_kv = mod.kv_shape
        if mod_kv is not None and shape is not None:
            d, kv, vd = mod_kv
            kv = max(kv // attn_tp_size, 1)
            vd = vd if vd is not None else d
            # a Legacy cache row holds a rank's heads flattened: one "head" of heads x dim (BSH)
            want = (kv * d, 1, kv * vd) if legacy else (d, kv, vd)
            if want != shape:
                kv_off.append((layer, mod, shape, want))
        if mod.sinks != facts.has_sinks_at(layer.decoder_layer):
            sinks_off.append((layer, mod))
        module_facts = dict(mod.kind_facts)
        hf_source = module_facts.pop(KV_SOURCE_FACT, None)
        if (calls := module_facts.pop(CALLS_FACT, None)) is not None and not _differential_planned(layer, mod, calls):
            calls_off.append((layer, mod, calls))
        if (tiles := module_facts.pop(TILED_FACT, None)) is not None:
            tiled.append((layer, mod, tiles))
        if (queries := module_facts.pop(QUERY_FACT, None)) not in (None, facts.heads_at(layer.decoder_layer)):
            how = f"K/V tiled {tiles} x {queries // tiles} KV heads" if tiles else ".num_heads"
            queries_off.append((layer, mod, queries, how))
        # a drafter's layer reads its target's K/V: transformers' module is KV-shared with no store layer in this
        # model (-1); a module that computes its own K/V (None) beside a drafter plan is off
        want_source = -1 if layer.reads_target else layer.kv_source_layer
        if hf_source != want_source:
            source_off.append((layer, mod, hf_source))
        off = fmt.hf_off(layer, {k: v for k, v in module_facts.items() if not k.startswith(MIXER_FACT)}, mod.cls)
        if off:
            format_off.append((layer, mod, off))
    if no_attention:
        layer, mod = no_attention[0]
        device_side = bool(mod.unread) and UNREAD_MARK not in mod.unread  # a reason on the device path (LSH)
        holds = f", a block holding {mod.recurrent_beside}" if mod.recurrent_beside else \
            f", a block holding {mod.unread}" if device_side else \
            f", a block holding {mod.unread} (projections kvcache does not read: not supported by kvcache yet)" \
            if mod.unread else ""
        (result.unsupported if device_side else result.errors).append(
            f"analyzer plans attention ({layer.attn_type}) on {len(no_attention)} layer(s) where transformers' "
            f"decoder block has no attention module, first layer {layer.index} at {mod.path}{holds}")
    if state_off:
        layer, mod, off = state_off[0]
        result.errors.append(f"recurrent state (planned vs transformers' {mod.recurrent_beside or mod.cls}): {off} on "
                             f"{len(state_off)} layer(s), first layer {layer.index} at {mod.path}")
    if beside_off:
        layer, mod = beside_off[0]
        result.errors.append(
            f"transformers' decoder block holds a recurrent mixer ({mod.recurrent_beside}) beside its attention "
            f"({mod.cls}) on {len(beside_off)} layer(s), first layer {layer.index}: its state is not planned (kvcache "
            "plans recurrent states only for layers without attention)")
    if scale_off:
        layer, mod = scale_off[0]
        planned, planned_txt = (layer.softmax_scale, layer.scale_derivation) if layer.softmax_scale else (scale,
                                                                                                         scale_txt)
        result.errors.append(
            f"softmax scale: analyzer {planned:.9g} ({planned_txt}) vs transformers {mod.scale[0]:.9g} "
            f"({mod.cls}.{mod.scale[1]}) on {len(scale_off)} layer(s), first {mod.path}")
    if window_off:
        layer, mod, w = window_off[0]
        result.errors.append(
            f"sliding window: analyzer {layer.sliding_window} ({layer.attn_type}) vs transformers {w} "
            f"({mod.cls}.sliding_window) on {len(window_off)} layer(s), "
            f"first layer {layer.index} at {mod.path}")
    if kv_off:
        layer, mod, shape, want = kv_off[0]
        result.errors.append(
            f"KV cache per rank (key dim, KV heads, value dim): analyzer {shape} vs transformers {want} "
            f"({mod.cls}: k_proj / v_proj / head_dim at attn TP {attn_tp_size}) on {len(kv_off)} layer(s), first "
            f"layer {layer.index} at {mod.path}")
    if sinks_off:
        layer, mod = sinks_off[0]
        planned = "none" if not facts.has_sinks.value else "on every layer" if facts.sink_layers.value is None \
            else f"on layers {list(facts.sink_layers.value)}"
        result.errors.append(
            f"attention sinks: analyzer {planned} "
            f"({facts.has_sinks.source}) vs transformers {'with' if mod.sinks else 'without'} "
            f"{mod.cls}.sinks on {len(sinks_off)} layer(s), first layer {layer.index} at {mod.path}")
    if source_off:
        layer, mod, want = source_off[0]
        planned = "the target model's cache" if layer.reads_target else "its own K/V cache" \
            if layer.kv_source_layer is None else f"layer {layer.kv_source_layer}'s cache"
        hf_said = "its own K/V (k_proj / v_proj)" if want is None else "K/V computed outside the model (" \
            f"{mod.cls}.is_kv_shared_layer with no store layer of its type)" if want == -1 else \
            f"layer {want}'s K/V ({mod.cls}.is_kv_shared_layer, config kv_sharing_modes)"
        result.errors.append(f"KV sharing: analyzer plans layer {layer.index} reading {planned} vs transformers "
                             f"{hf_said} on {len(source_off)} layer(s), first at {mod.path}")
    if format_off:
        layer, mod, off = format_off[0]
        result.errors.append(f"{off} on {len(format_off)} layer(s), first layer {layer.index} at {mod.path}")
    if queries_off:
        layer, mod, queries, how = queries_off[0]
        planned = facts.heads_at(layer.decoder_layer)
        src = facts.num_attention_heads.source if planned == facts.num_attention_heads.value else facts.layer_mla.source
        result.errors.append(f"query heads: analyzer {planned} ({src})"
                             f" vs transformers {queries} ({mod.cls}{'' if how.startswith('.') else ': '}{how}) on "
                             f"{len(queries_off)} layer(s), first layer {layer.index} at {mod.path}")
    if tiled:
        layer, mod, tiles = tiled[0]
        result.notes.append(
            f"query heads grouped otherwise than FA's: transformers' {mod.cls} tiles its K/V {tiles} times to its query "
            f"heads (key_states.repeat(1, {tiles}, 1, 1): query head e x KV heads + h reads KV head h) on {len(tiled)} "
            f"layer(s), first {mod.path}; FA's GQA pairs query head j with KV head j // {tiles} (num_key_value_heads), "
            f"so a port hands FA its queries KV-head-major ([KV heads, {tiles}]) and turns the output back before the "
            "output projection (the validation host's moa route does)")
    if calls_off:
        layer, mod, calls = calls_off[0]
        result.unsupported.append(
            f"differential attention: transformers' {mod.cls}.forward calls the attention interface {calls} times "
            f"over one K/V cache on {len(calls_off)} layer(s), first layer {layer.index} at {mod.path}, each call "
            "with the value heads regrouped after the cache update (softmax(QK^T) V1 - lambda softmax(QK^T) V2, "
            "then a group norm): a query head reads value heads other than its key head's, and the paged FA "
            "operator pairs key head j with value head j only, its key and value caches of one shape (torch_npu "
            "npu_fused_infer_attention_score, num_key_value_heads; with page attention its key and value shapes must match); "
            "kvcache plans a layout for DiffLlama's pattern only (a module holding its lambdas and group norm, two "
            "calls: K/V as two half-head caches each, analyzer/kinds/diff.py), and this module's calls are not it")
    return result


def _differential_planned(layer: LayerPlan, mod: HfAttention, calls: int) -> bool:
    """The module's two attention calls are DiffLlama's differential pattern (its lambdas and group norm, two calls)
    and the layer plans its four half-head caches (analyzer/kinds/diff.py): served, not refused."""
    return calls == 2 and dict(mod.kind_facts).get(DIFF_FACT) is not None and \
        {c.name for c in layer.caches} >= set(DIFF_CACHES)


def _planned_kv_shape(layer: LayerPlan) -> tuple[int, int, int] | None:
    """(key dim, KV heads per rank, value dim) of a layer's k_cache / v_cache, None for other caches (MLA's latent);
    a differential layer's K heads are its two half-head key caches'."""
    caches = {c.name: c for c in layer.caches}
    k, v = caches.get("k_cache"), caches.get("v_cache")
    if k is None:
        return None
    heads = k.num_head + (caches[DIFF_CACHES[2]].num_head if DIFF_CACHES[2] in caches else 0)
    return k.dim, heads, v.dim if v is not None else k.dim  # K=V layers (Gemma-4) keep no v_cache
