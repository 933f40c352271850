"""Generators of the tables in ``references/`` (``python -m validators.docgen.doc_tables``)."""
