"""Benchmarks (`make bench`): end-to-end throughput and kernel bandwidth, run on the GPU."""
