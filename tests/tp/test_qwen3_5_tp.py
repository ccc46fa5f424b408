"""Qwen3.5 hybrid models (dense and MoE) under tensor parallelism on the CPU.

- One Gated DeltaNet layer sharded over 2 ranks in one process (no collective is needed to
  check it): the ranks' out_proj partial sums add up to the unsharded layer's output, over a
  ragged prefill and a decode step continuing from the state, and each rank's state slots
  hold exactly its heads' share of the unsharded layer's states.
- Through ``LLM(tensor_parallel_size=2)`` (2 processes over gloo), dense and MoE with a shared
  expert: greedy tokens equal transformers' and TP=1's, with chunked prefill and prefix-cache
  hits resuming from state snapshots, in both scheduling modes (one ``LLM`` per model); and
  Qwen3-Next, whose fused DeltaNet projections each rank reads by heads, in one mode.
- A DeltaNet head count that does not divide by the ranks is refused, naming the field.

Which planted bug each test catches (each was planted and seen to fail):
- the conv filters sharded contiguously (rank 0 the first conv_dim / 2 channels) instead of
  q, k and v each: ``test_sharded_delta_net_sums_to_the_unsharded_layer`` and the engine test;
- z taken from the q/k/v rows of in_proj: both tests as well.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.layers.linear_attention import GatedDeltaNet, allocate_linear_state, qkv_segments
from minivllm.ops.dispatch import Ops
from minivllm.ops.metadata import AttentionMetadata, StateMetadata
from minivllm.testing import hf_generate
from tests.model.test_qwen3_5 import MODELS, make_hf, write_config

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

TP = 2
BS = 4                # block size
NEW = 6               # greedy tokens per completion
PREFIX = 18           # the shared prefix: 4 full blocks and 2 tokens
TAILS = (3, 7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_seqs=8,
              max_model_len=64, num_blocks=64, max_num_batched_tokens=11, enable_prefix_caching=True,
              state_snapshot_interval=2)
# 8 sequences: 32 snapshots, so the first mode's (bound while their blocks stay cached) leave
# room for the second mode's.


def prompt_sets(vocab: int, seed: int) -> dict[str, list[list[int]]]:
    """Plain prompts, and tails on one shared prefix: "cold" fills the cache, "warm" hits it."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, PREFIX).tolist()
    return {"plain": [rng.integers(0, vocab, n).tolist() for n in (5, 23)],
            "cold": [prefix + rng.integers(0, vocab, n).tolist() for n in TAILS],
            "warm": [prefix + rng.integers(0, vocab, n).tolist() for n in TAILS]}


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# ---- one DeltaNet layer, sharded -----------------------------------------------------------

def load_delta_net(config: ModelConfig, weights: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> GatedDeltaNet:
    """A DeltaNet layer (rank ``tp_rank`` of ``tp_size``) loaded through its weight loaders
    from one transformers layer's ``linear_attn`` tensors."""
    layer = GatedDeltaNet(config, 0, tp_rank, tp_size)
    for shard, name in enumerate(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        layer.in_proj.weight.weight_loader(layer.in_proj.weight, weights[f"{name}.weight"], shard)
    for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        param = layer.get_parameter(name)
        param.weight_loader(param, weights[name])
    return layer


def run_steps(layer: GatedDeltaNet, config: ModelConfig, tp_size: int, xs: list[torch.Tensor],
              steps: list[list[int]], kernels: str) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Feed each step's rows (tokens per sequence; the first step starts both sequences fresh
    in slots 3 and 1 over garbage) -> every step's (T, hidden) output and the final states."""
    gen = torch.Generator().manual_seed(0)
    states = allocate_linear_state(config, 4, torch.float32, "cpu", tp_size)
    for s in states:
        s.copy_(torch.randn(s.shape, generator=gen))
    ops, outs, fed = Ops.build(kernels, torch.device("cpu"), torch.float32), [], [0, 0]
    for i, lens in enumerate(steps):
        h = torch.cat([xs[b][fed[b]:fed[b] + n] for b, n in enumerate(lens)])
        state = StateMetadata(slots=torch.tensor([3, 1]), has_initial_state=torch.tensor([i > 0, i > 0]),
                              conv_state=states[0], recurrent_state=states[1])
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64),
                                 cu_seqlens_q=torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32),
                                 kv_lens=torch.tensor(lens, dtype=torch.int32),
                                 block_tables=torch.zeros(2, 1, dtype=torch.int32), max_q_len=max(lens),
                                 is_decode=all(n == 1 for n in lens), kv_cache=torch.zeros(0), state=state)
        with torch.no_grad():
            outs.append(layer(ops, h, meta).clone())
        fed = [f + n for f, n in zip(fed, lens)]
    return outs, states


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_sharded_delta_net_sums_to_the_unsharded_layer(tmp_path: Path, kernels: str) -> None:
    """The ranks' partial sums add up to the unsharded output at every step; each rank's conv
    state holds its q, k and v channels and its recurrent state its value heads (the torch
    references, and the Triton kernels under the interpreter, on the rank's state shapes)."""
    arch, settings = MODELS["dense-lin-first"]
    hf = make_hf(arch, settings, seed=3)
    config = ModelConfig.from_hf_json(write_config(tmp_path, arch))
    weights = {k: v.detach() for k, v in hf.model.layers[0].linear_attn.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, config.hidden_size, generator=gen) for n in (13, 6)]
    steps = [[11, 5], [1, 1]]  # a ragged prefill, then one token each from the state
    want, (conv, recurrent) = run_steps(load_delta_net(config, weights, 0, 1), config, 1, xs, steps, kernels)
    got = [run_steps(load_delta_net(config, weights, r, TP), config, TP, xs, steps, kernels) for r in range(TP)]
    for i, out in enumerate(want):
        torch.testing.assert_close(sum(outs[i] for outs, _ in got), out, atol=1e-5, rtol=1e-5)
    heads = config.linear_num_value_heads // TP
    for r, (_, (rank_conv, rank_recurrent)) in enumerate(got):  # the layer's row 0, slots 3 and 1
        channels = torch.cat([conv[0, [3, 1], start:start + n] for _, start, n in qkv_segments(config, r, TP)], dim=1)
        torch.testing.assert_close(rank_conv[0, [3, 1]], channels)
        torch.testing.assert_close(rank_recurrent[0, [3, 1]], recurrent[0, [3, 1], r * heads:(r + 1) * heads])


# ---- end to end ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dense-lin-first", "moe-shared-full-first"])
def test_tp2_tokens_equal_transformers_with_prefix_hits(tmp_path: Path, name: str) -> None:
    """Chunked prefill (11-token budget) and prefix hits resuming from snapshots (every 2nd
    block), both scheduling modes on one TP=2 engine (fresh prompts for each mode): the tokens
    are transformers' and TP=1's, and every warm prompt reuses 16 tokens (block 4's snapshot)."""
    arch, settings = MODELS[name]
    hf = make_hf(arch, settings, seed=list(MODELS).index(name))
    hf.save_pretrained(tmp_path)
    sets = [prompt_sets(hf.config.vocab_size, seed) for seed in (0, 1)]
    refs = [{kind: [hf_generate(hf, p, NEW) for p in ps] for kind, ps in s.items()} for s in sets]
    with LLM(str(tmp_path), **ENGINE) as one:
        assert tokens(one, sets[0]["plain"]) == refs[0]["plain"]
    with LLM(str(tmp_path), **ENGINE, tensor_parallel_size=TP) as two:
        for async_scheduling, prompts, want in zip((False, True), sets, refs):
            two.engine.set_async_scheduling(async_scheduling)
            assert_tokens_and_hits(two, prompts, want)


def assert_tokens_and_hits(llm: LLM, prompts: dict[str, list[list[int]]], want: dict[str, list[list[int]]]) -> None:
    """``prompt_sets``' prompts give ``want``'s tokens, and each warm one reuses 16 tokens."""
    mode = f"async_scheduling={llm.engine.async_scheduling}"
    assert tokens(llm, prompts["plain"]) == want["plain"], mode
    assert tokens(llm, prompts["cold"]) == want["cold"], mode
    warm = llm.generate(prompts["warm"], GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in warm] == want["warm"], mode
    assert [o.num_cached_tokens for o in warm] == [16] * len(TAILS)


def test_tp2_qwen3_next_tokens_equal_transformers(tmp_path: Path) -> None:
    """Qwen3-Next over 2 ranks (each reads its q/k head's rows of the fused DeltaNet
    projections: 3 value heads per q/k head; dense and sparse layers), one scheduling mode:
    the tokens of the TP=2 test above."""
    from tests.model.test_qwen3_next import make_next

    hf = make_next("next-sparse-step", seed=7)
    hf.save_pretrained(tmp_path)
    prompts = prompt_sets(hf.config.vocab_size, 3)
    with LLM(str(tmp_path), **ENGINE, tensor_parallel_size=TP) as two:
        assert_tokens_and_hits(two, prompts, {kind: [hf_generate(hf, p, NEW) for p in ps]
                                              for kind, ps in prompts.items()})


def test_non_dividing_delta_net_heads_are_refused(tmp_path: Path) -> None:
    """3 q/k heads (6 value heads) over 2 ranks: refused before any process starts."""
    path = write_config(tmp_path, "Qwen3_5ForCausalLM", linear_num_key_heads=3, linear_num_value_heads=6)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        LLM(path, **ENGINE, tensor_parallel_size=TP)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        GatedDeltaNet(ModelConfig.from_hf_json(path), 0, tp_rank=0, tp_size=TP)


def test_tp2_mtp_drafts_equal_the_reference(tmp_path: Path) -> None:
    """The MTP head sharded over 2 ranks (its attention by heads, its MoE as the model's, fc
    replicated): every draft equals the reference head's from the same context, and the tokens
    are transformers'."""
    from minivllm.executor.base import DoneStep
    from tests.spec.test_mtp import drafting_context, save_with_head

    hf, head = save_with_head("moe-shared-full-first", tmp_path, seed=1)
    prompts = prompt_sets(hf.config.vocab_size, 2)
    want = [hf_generate(hf, p, NEW) for p in prompts["plain"] + prompts["cold"]]
    seen: list[tuple[list[int], list[int]]] = []
    with LLM(str(tmp_path), **ENGINE, tensor_parallel_size=TP,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        engine, submit = llm.engine, llm.engine.executor.submit
        engine.max_spec_backoff = 0

        def recorded(plan):
            result = submit(plan).result()
            for sid, drafts in result.drafts.items():
                seen.append((drafting_context(engine, plan, plan.seq_ids.index(sid)), drafts))
            return DoneStep(result)

        engine.executor.submit = recorded
        assert tokens(llm, prompts["plain"] + prompts["cold"]) == want
    assert len(seen) >= 8
    for context, drafts in seen:
        assert drafts == head.drafts(context, len(drafts))
