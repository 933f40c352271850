"""The validation run: inputs -> tiny model -> host with its backend -> request stream -> checks -> report.

``validate.validate`` is the one entry: ``load_inputs`` reads and checks the inputs once, then
``run_pipeline`` runs the rest on one rank, or ``multi_rank.run_ranks`` runs that same step on N
gloo ranks. Every other module is a stage it calls; none imports a stage above it (the layers are
in ARCHITECTURE.md, checked by tests/test_architecture.py):

- ``report``: the checks, their links and the JSON / Markdown report (every stage writes into it);
- ``provenance`` / ``runtime_deps`` / ``request_stream``: the inputs belong together and can run;
  the seeded prompts, late admits and early finishes;
- ``tiny_model``: the shrunk config and the random-weight transformers reference;
- ``host_model``: the host model the rendered attention plugs into, with its op backend;
- ``numeric`` / ``render_check``: the comparison with the reference, the render's constants;
- ``spec_decode``, then ``framework_run`` / ``standalone_run`` / ``legacy_run``: drive the stream per mode;
- ``multi_rank``: the same per-rank step on N gloo ranks, reports merged.
"""
