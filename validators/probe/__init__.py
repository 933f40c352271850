"""`kvcache probe`: settle the open device questions by measuring the device.

The questions and the readings file it writes are contracts the analyzer and validate read too:
they live in ``analyzer.device_questions`` and ``analyzer.readings_file`` (torch-free). The
experiments themselves (``experiments``, ``device``, ``run``) need torch and run on the NPU or,
for a dry run, on the CPU emulation.
"""
