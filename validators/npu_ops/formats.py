"""``npu_format_cast``: change a tensor's storage format (ND, FRACTAL_NZ, ...) on the device.

The format is a storage arrangement that every later operator reads transparently; the logical
values are unchanged. On CPU the emulation returns a contiguous copy with the same values. Only the
formats the recipes use are accepted (2 = ND, 29 = FRACTAL_NZ); other ACL format ids are refused
rather than passed through, and ``customize_dtype`` (a quantization feature) is not emulated.
"""

from __future__ import annotations

from model_infer_kvcache.validators.npu_ops import op_checks as chk

ACL_FORMATS = {2: "ND", 29: "FRACTAL_NZ"}
# Documented ACL formats the emulation does not accept (NCHW, NHWC, NC1HWC0, FRACTAL_Z, NDC1HWC0, ...).
OTHER_ACL_FORMATS = (0, 1, 3, 4, 30, 32, 33)


def npu_format_cast(self, acl_format, customize_dtype=None):
    """A copy of ``self`` (same values) standing for the ``acl_format`` arrangement."""
    op = "npu_format_cast"
    chk.tensor(op, "self", self)
    chk.integer(op, "acl_format", acl_format)
    chk.choice(op, "acl_format", acl_format, tuple(ACL_FORMATS), documented=OTHER_ACL_FORMATS)
    chk.absent(op, customize_dtype=customize_dtype)
    return self.contiguous().clone()


OPS = {"npu_format_cast": npu_format_cast}
