"""Compute kernels, one folder per op: a plain torch reference (`naive.py`) beside each fast form,
sharing one signature and shape docstring, so tests can compare them directly."""
