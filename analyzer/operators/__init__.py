"""Operator facts, one home: the pinned torch_npu schemas and what their arguments mean.

* :mod:`analyzer.operators.schemas` - the real torch-npu 2.9.0 schemas (``op_schemas.json``):
  which arguments each operator accepts, in which order, with which defaults.
* :mod:`analyzer.operators.fa_facts` - what the schemas cannot say: which v1 and v2 fused-attention
  keywords are the same argument, and the named FA constants (``INT32_MAX``, sparse modes, ...).

Stdlib only, so the implementer (templates context) and the linter read it without torch; the
emulator front ends, the validation checks and the doc tables derive their tables from it too.
"""
