"""What kvcache cannot validate yet, said as such: "not supported by kvcache: <what>" (exit 2), never a model failure.

Two moments. Once the model class is known, ``preflight(config_path, real_config)`` reads the config for the cache
kinds the framework-cache checks cannot judge yet (linear-attention / recurrent layers in framework-owned caches; a
Legacy model that owns them is validated by its logits). During the
run, ``unsupported_operator(exc, model_frame)`` turns an operator the emulation lacks into the same one line when the operator is real (a torch-npu release of
``analyzer/operators/op_names.json`` defines it) or a feature of an emulated operator that is not emulated;
an operator no release defines stays the model's own error (exit 1, at its file:line).
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.config_loader import model_section
from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache

# layer_types values of cache kinds the tool has no spec for yet (analyzer/kv_cache_spec.py)
_LINEAR_LAYER_TYPES = ("linear_attention", "mamba", "gated_delta_net", "recurrent")
# config fields that say some layers are linear attention without listing layer_types
_LINEAR_FIELDS = ("full_attention_interval", "linear_num_value_heads", "linear_num_heads")


def preflight(config_path: str, real: dict) -> None:
    """Raise ``NotSupportedByKvcache`` naming the config field of a kind the tool cannot validate yet."""
    src = model_section(real)[0]
    types = src.get("layer_types") if isinstance(src.get("layer_types"), list) else []
    linear = sorted({t for t in types if t in _LINEAR_LAYER_TYPES})
    linear_fields = [f for f in _LINEAR_FIELDS if src.get(f) is not None]
    if linear or linear_fields:
        what = f"layer_types {linear}" if linear else linear_fields[0]
        raise NotSupportedByKvcache(config_path, f"linear-attention layers ({what}: a recurrent state, "
                                                 "MambaCacheEntry) in framework-owned caches of a checkout's engine "
                                                 "are not validated yet (a model that owns its caches, Legacy, is; "
                                                 "rendered gated-delta-net states are too: kvcache render, then "
                                                 "kvcache validate --rendered)",
                                    field="layer_types" if linear else linear_fields[0])


def unsupported_operator(exc: BaseException, where: str, root=None) -> NotSupportedByKvcache | None:
    """The one line for an operator (or an operator's feature) the emulation lacks, or None when ``exc`` is
    not that (a model error, an operator's refusal, an operator neither a torch-npu release nor the checkout
    ``root`` (its ``ops/ascendc/docs/custom-<op>.md``) defines)."""
    from model_infer_kvcache.analyzer.operators.schemas import PINNED_RELEASE, releases_defining
    from model_infer_kvcache.validators.npu_ops.errors import UnemulatedFeatureError, UnemulatedOperatorError

    if isinstance(exc, UnemulatedFeatureError):
        return NotSupportedByKvcache(where, f"{exc} (an emulated operator's feature)", field=f"{exc.op}")
    if isinstance(exc, UnemulatedOperatorError) and exc.op.startswith(("custom_ops.", "torch.ops.custom.")):
        name = exc.op.rsplit(".", 1)[-1]
        return NotSupportedByKvcache(where, f"operator {exc.op} (the checkout's own AscendC operator, "
                                            f"ops/ascendc/docs/custom-{name}.md) is not emulated on CPU", field=exc.op)
    if isinstance(exc, UnemulatedOperatorError):
        name = exc.op.rsplit(".", 1)[-1]
        releases = releases_defining(name)
        doc = f"ops/ascendc/docs/custom-{name}.md"
        if not releases and root is not None and (root / doc).is_file():
            # the checkout's own operator reached through torch_npu (DeepSeek-V3.2's KV offload path)
            return NotSupportedByKvcache(where, f"operator {exc.op} (the checkout's own AscendC operator, {doc}) is "
                                                "not emulated on CPU", field=exc.op)
        if not releases:
            return None
        doc = "the pinned release" if PINNED_RELEASE in releases else f"torch-npu {', '.join(releases)}"
        return NotSupportedByKvcache(where, f"operator {exc.op} (defined by {doc}) is not emulated on CPU "
                                            "(references/emulated_ops.md)", field=exc.op)
    return None
