"""Sampling on the device: one token per row without a host sync (``sampler``), the
repetition / frequency / presence penalties (``penalties``) and the log-probabilities
returned with the tokens (``logprobs``). Which implementation runs (the fused Triton pass or
its torch reference) is the dispatch point's choice (``minivllm.ops.dispatch.Ops``)."""
