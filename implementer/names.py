"""Names the user may give the rendered classes and attributes (`kvcache render --attention-class` ...).

Kept apart from template_context so that `kvcache render --help` shows the defaults without loading the
manifest models.
"""

from __future__ import annotations

import keyword
import unicodedata
from dataclasses import dataclass

from model_infer_kvcache.analyzer.errors import InputError

# Module-level names of the rendered files (imports, helpers); UPPER_CASE names are their constants.
RESERVED_NAMES = frozenset({"torch", "torch_npu", "math", "dataclass", "CacheEntry", "LayerCacheInfo",
                            "ModelCacheInfo", "ForwardMetaData", "attention_modules", "as_int32",
                            "MambaCacheEntry", "F", "l2norm", "KVCacheLinearStateMixin"})


def check_identifier(value: str, flag: str) -> str:
    # Non-ASCII identifiers are Python (PEP 3131), but Python binds the NFKC form: a name that
    # normalizes to another would not be the name the user's code refers to.
    if not value.isidentifier() or keyword.iskeyword(value) or unicodedata.normalize("NFKC", value) != value:
        raise InputError(flag, f"{value!r} is not a valid Python identifier"
                         + (" (Python reads it as its NFKC form)" if value.isidentifier() else ""))
    return value


@dataclass(frozen=True)
class Names:
    attention_mixin: str = "KVCacheAttentionMixin"
    model_mixin: str = "KVCacheModelMixin"
    runner_mixin: str = "KVCacheRunnerMixin"
    attn_attr: str = "self_attn"

    def checked(self) -> Names:
        classes = (("--attention-class", self.attention_mixin), ("--model-class", self.model_mixin),
                   ("--runner-class", self.runner_mixin))
        for flag, value in (*classes, ("--attn-attr", self.attn_attr)):
            check_identifier(value, flag)
        for flag, value in classes:
            # A class named like a module-level name of the rendered files would shadow it.
            if value in RESERVED_NAMES or value.isupper():
                raise InputError(flag, f"{value!r} would shadow a name the rendered module uses; pick another")
        seen: dict[str, str] = {}
        for flag, value in classes:
            if value in seen:
                raise InputError(flag, f"{value!r} is also the {seen[value]} name: each class needs its own")
            seen[value] = flag
        return self
