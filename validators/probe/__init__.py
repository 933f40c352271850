"""`kvcache probe`: settle the open device questions by measuring the device.

Torch-free modules (``questions``, ``readings_file``) are what ``kvcache analyze`` imports; the
experiments themselves (``experiments``, ``device``, ``run``) need torch and run on the NPU or,
for a dry run, on the CPU emulation.
"""
