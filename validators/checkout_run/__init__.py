"""Validate a cann-recipes-infer model file in the checkout's own framework, on CPU, against transformers.

``validate_checkout(CheckoutRequest(...)) -> Report``: the checkout's registry, weight loader,
Scheduler, ExecutionEngine and kv_cache run the model file (or an edited copy, ``model_file``)
over the validation request stream; see ``validators.checkout_run.validate``.
"""

from model_infer_kvcache.validators.checkout_run.validate import (
    ENGINE_QUICK,
    ENGINE_STREAM,
    CheckoutRequest,
    validate_checkout,
)

__all__ = ["ENGINE_QUICK", "ENGINE_STREAM", "CheckoutRequest", "validate_checkout"]
