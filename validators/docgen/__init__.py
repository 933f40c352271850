"""Generators of the tables in ``references/`` (``python -m model_infer_kvcache.validators.docgen.doc_tables``)."""
