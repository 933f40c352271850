"""What kvcache cannot validate yet, said as such: "not supported by kvcache: <what>" (exit 2), never a model failure.

Two moments. Once the model class is known, ``preflight(config_path, manifest)`` refuses linear-attention layers the
manifest names no validation reference for (``linear_attention.reference`` null). Every family the analyzer plans
has one today (transformers' gated delta net and KDA classes; for Ling-2.5's lightning attention, which transformers
lacks, kvcache's own reference: ``validators/pipeline/ling_lightning.py``), so only a manifest written by an older
kvcache (which left Ling-2.5's null) meets it: re-analyze.
During the run, ``unsupported_operator(exc, model_frame)`` turns an operator the emulation lacks into the same one
line when the operator is real (a torch-npu release of ``analyzer/operators/op_names.json`` defines it) or a feature
of an emulated operator that is not emulated; an operator no release defines stays the model's own error (exit 1,
at its file:line).
"""

from __future__ import annotations

from model_infer_kvcache.analyzer.errors import NotSupportedByKvcache


def preflight(config_path: str, manifest) -> None:
    """Raise ``NotSupportedByKvcache`` naming the config's linear-attention family when the manifest names no
    reference for it (``manifest.linear_attention.reference`` is None: a manifest of an older kvcache)."""
    lin = manifest.linear_attention
    if lin is not None and lin.reference is None:
        raise NotSupportedByKvcache(config_path, f"linear-attention layers of family {lin.family} ({lin.source}): "
                                                 "the manifest names no reference to compare the logits with "
                                                 "(linear_attention.reference is null; re-run kvcache analyze)",
                                    field="model_type")


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
