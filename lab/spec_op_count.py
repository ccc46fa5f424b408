"""How many torch ops a step's host issues, by the executor's stage, with and without drafts
(each op is a launch on CUDA: a few microseconds of the host's step). CPU, a tiny random
model; every step drafts (the back-off is held off), k = 4, drafts always wrong.

    PYTHONPATH=. python3 lab/spec_op_count.py
"""

from __future__ import annotations

import collections
import functools
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.executor import model_executor  # noqa: E402
from minivllm.testing import ReplayProposer, TinyConfig, make_hf_model, save_hf_model  # noqa: E402

STAGES = ("prepare", "_sample", "_verify_drafts", "_drafted_logprobs", "_results")


class OpCount(TorchDispatchMode):
    """Counts aten ops by the outermost executor stage running them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.stage: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.stage] += 1
        return func(*args, **(kwargs or {}))


def staged(counter: OpCount, name: str):
    f = getattr(model_executor.ModelExecutor, name)

    @functools.wraps(f)
    def run(*a, **k):
        outer = counter.stage
        counter.stage = outer or name
        try:
            return f(*a, **k)
        finally:
            counter.stage = outer
    return run


def main() -> None:
    counter = OpCount()
    for name in STAGES:
        setattr(model_executor.ModelExecutor, name, staged(counter, name))
    path = save_hf_model(make_hf_model(TinyConfig(), seed=5), tempfile.mkdtemp())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", kernels="torch", skip_tokenizer_init=True, block_size=4,
             num_blocks=64, max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        llm.engine.proposer = None
        truth = {tuple(prompt): llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids}
        llm.engine._spec_outcome = lambda useful: None
        for name, proposer, params in (("no drafts", None, greedy),
                                       ("greedy, k 4 wrong", ReplayProposer(truth, len(prompt), 4, 0.0, 97), greedy),
                                       ("sampled, k 4 wrong", ReplayProposer(truth, len(prompt), 4, 0.0, 97), sampled)):
            llm.engine.proposer = proposer
            steps = llm.engine.stats.num_steps
            counter.counts.clear()
            with counter:
                llm.generate([prompt], params, use_tqdm=False)
            steps = llm.engine.stats.num_steps - steps
            print(f"{name}: ops a step " + ", ".join(f"{stage} {counter.counts[stage] / steps:.1f}"
                                                     for stage in STAGES if counter.counts[stage]))


if __name__ == "__main__":
    main()
