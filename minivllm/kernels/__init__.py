"""Attention kernels: one Triton kernel per file with its launcher, plus torch references."""
