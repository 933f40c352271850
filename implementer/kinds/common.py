"""What every kind's render module shares: the refusal naming a manifest field, the rendered torch dtypes."""

from __future__ import annotations

from model_infer_kvcache.analyzer.errors import InputError

# The torch dtype each manifest dtype renders as (cache and state constants of the generated code).
TORCH_DTYPE = {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32",
               "int8": "torch.int8"}


def bad(field: str, message: str) -> InputError:
    return InputError("--manifest", message, field=field)
