"""CPU stand-ins for the Ascend device stack (``torch_npu``, ``torchair``, ``torch.npu``, ``Tensor.npu``).

``device_standins()`` installs them for one validation scope so that a checkout's own modules
(``executor.core.kv_cache`` and what it imports) load and run on CPU; everything is removed on
exit. Nothing is written into the checkout.
"""

from model_infer_kvcache.validators.standins.device import (
    NotStoodInError,
    StandinHandle,
    custom_ops_standin,
    device_standins,
    standins_active,
    torchair_standin,
)

__all__ = ["NotStoodInError", "StandinHandle", "custom_ops_standin", "device_standins", "standins_active",
           "torchair_standin"]
