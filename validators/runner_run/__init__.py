"""`kvcache validate --runner-root FOLDER`: a standalone model folder's own runner on CPU (validate.py)."""

from model_infer_kvcache.validators.runner_run.validate import RunnerRequest, validate_runner

__all__ = ["RunnerRequest", "validate_runner"]
