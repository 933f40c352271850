"""The validation run: inputs -> tiny model -> host with its backend -> request stream -> checks -> report.

``validate.validate`` is the one entry; everything else here is a step it calls:

- ``provenance`` / ``render_check`` / ``runtime_deps``: the inputs belong together and can run;
- ``tiny_model``: the shrunk config and the random-weight transformers reference;
- ``host_model``: the host model the rendered attention plugs into, with its op backend;
- ``request_stream``: the seeded prompts, late admits and early finishes;
- ``framework_run`` / ``standalone_run`` / ``legacy_run`` / ``spec_decode``: drive the stream per mode;
- ``numeric``: the comparison with the reference; ``multi_rank``: the same run on N gloo ranks;
- ``report``: the checks, their links and the JSON / Markdown report.
"""
