"""model-infer-kvcache: analyze, render and validate paged KV-cache designs for Ascend NPUs.

The one installed package. Its parts keep their folders at the repository root (the bundle's layout:
``analyzer/``, ``implementer/``, ``templates/``, ``validators/``) and install as subpackages of this one
(``model_infer_kvcache.analyzer`` ...), so nothing lands under a generic top-level name; the ``kvcache``
command is ``model_infer_kvcache.cli``.
"""
