"""Triton kernels: one kernel per file with its launcher, and their torch references
(``reference``, or beside the kernel)."""
