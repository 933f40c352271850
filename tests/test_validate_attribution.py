"""A V201 failure says where it was raised when no frame of the rendered code is on the stack (validators/pipeline/
validate.py ``_raised_outside_render``): a crash of kvcache's own host (Gemma-3n's AltUp outputs crashed the
localisation and read as the render's operator error) is then told apart from the render's."""

from __future__ import annotations

import importlib.util

from model_infer_kvcache.validators.pipeline.validate import _raised_outside_render


def _raise_from(path):
    path.write_text("def boom():\n    raise ValueError('shape')\n", encoding="utf-8")
    spec = importlib.util.spec_from_file_location("boom_mod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.boom()
    except ValueError as exc:
        return exc


def test_an_error_raised_in_the_rendered_code_is_not_annotated(tmp_path):
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    assert _raised_outside_render(_raise_from(rendered / "kvcache_attention.py"), rendered) == ""


def test_an_error_raised_elsewhere_names_its_file_and_line(tmp_path):
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    note = _raised_outside_render(_raise_from(tmp_path / "host_model.py"), rendered)
    assert note == " (raised at host_model.py:2 in boom; no frame of the rendered code on the stack)"
