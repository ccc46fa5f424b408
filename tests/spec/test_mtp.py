"""Qwen3.5's MTP head as the proposer (``speculative_config={"method": "mtp"}``), float32 on the
CPU, against a reference built from transformers' own layer and norm classes (transformers
drops ``mtp.*`` on load, so its modules are assembled here from the checkpoint's tensors):

- the head alone: logits equal the reference's, and K/V stored by the K/V-only pass equal the
  whole layer's;
- through ``LLM``: greedy tokens equal transformers' with and without the head, every draft the
  executor makes equals the reference's chain of drafts from the same context (so the hidden
  states it drafts from, its K/V cache and the pairing of token t + 1 with hidden t are all
  right), through prefix hits that resume from snapshots, chunked prefill under preemption,
  and both scheduling modes;
- refusals: a checkpoint without the head, more than one MTP layer, a model of another family.

Qwen3-Next's head (the same tensors) runs the head and the drafting tests on a model whose
layer 0 is dense, so its MTP layer is too (``mtp_layer_config``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from minivllm import LLM, SamplingParams
from minivllm.config import MTP_LAYERS_KEYS, ModelConfig, SpeculativeConfig
from minivllm.model.loader import load_weights
from minivllm.model.qwen3_5_mtp import attach_mtp
from minivllm.model.registry import build_model
from minivllm.ops.metadata import AttentionMetadata
from minivllm.testing import hf_generate
from tests.model.test_qwen3_5 import MODELS, make_hf
from tests.model.test_qwen3_next import MODELS as NEXT_MODELS
from tests.model.test_qwen3_next import make_next

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

K = 3          # drafts per step
BS = 4         # KV block size
NEW = 10       # greedy tokens per completion


class HFHead:
    """The MTP head from transformers' classes: its decoder layer (layer 0 of a copy of the
    config whose layer 0 is full attention: the MLP is layer 0's, as ``mtp.layers.0``'s),
    zero-centred norms and fc, with random weights; ``tensors``: them under the checkpoint's
    ``mtp.*`` names."""

    def __init__(self, hf: transformers.PreTrainedModel, seed: int) -> None:
        cfg = copy.deepcopy(hf.config)
        cfg.layer_types = ["full_attention", *cfg.layer_types[1:]]
        torch.manual_seed(seed)
        module = type(hf.model.layers[0])  # Qwen3_5DecoderLayer / Qwen3_5MoeDecoderLayer / Qwen3NextDecoderLayer
        norm = type(hf.model.norm)
        self.hf = hf
        self.layer = module(cfg, 0).float().eval()
        h = cfg.hidden_size
        self.norm, self.norm_e, self.norm_h = (norm(h, eps=cfg.rms_norm_eps).float() for _ in range(3))
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        parts = {"layers.0": self.layer, "norm": self.norm, "pre_fc_norm_embedding": self.norm_e,
                 "pre_fc_norm_hidden": self.norm_h, "fc": self.fc}
        self.tensors = {}
        with torch.no_grad():
            for prefix, part in parts.items():
                for name, p in part.named_parameters():
                    if name.endswith("norm.weight") or prefix.startswith("pre_fc") or prefix == "norm":
                        p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.2 * torch.randn_like(p))
                    else:
                        p.normal_(0.0, 0.1)
                    self.tensors[f"mtp.{prefix}.{name}"] = p.detach().clone().contiguous()

    @torch.no_grad()
    def run(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Causal over n positions 0..n-1: (n,) tokens t + 1 and (n, H) hidden states at t -> the
        head's normed outputs (n, H)."""
        n = len(next_tokens)
        e = self.hf.model.embed_tokens(torch.tensor(next_tokens))
        x = self.fc(torch.cat([self.norm_e(e), self.norm_h(hidden)], dim=-1))[None]
        positions = torch.arange(n)
        rotary = self.hf.model.rotary_emb
        ids = positions[None]
        if type(rotary).__name__.startswith("Qwen3_5"):  # multimodal RoPE: a text position thrice
            ids = ids.expand(3, 1, n)  # (transformers 5.17 takes only this form, 5.25 either)
        pe = rotary(x, ids)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=positions[None])
        y = y[0] if isinstance(y, tuple) else y
        return self.norm(y[0])

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.hf.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]

    def drafts(self, context: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after ``context`` (its last token known, not yet fed)."""
        hidden = self.target_hidden(context)[:-1]
        tokens, out = list(context[1:]), []
        for _ in range(k):
            o = self.run(tokens, hidden)[-1]
            d = int(self.hf.lm_head(o).argmax())
            out.append(d)
            tokens.append(d)
            hidden = torch.cat([hidden, o[None]])
        return out


def save_with_head(name: str, path: Path, seed: int) -> tuple[transformers.PreTrainedModel, HFHead]:
    """``name`` of test_qwen3_5's or test_qwen3_next's models, saved with an MTP head."""
    hf = make_next(name, seed) if name in NEXT_MODELS else make_hf(*MODELS[name], seed=seed)
    hf.save_pretrained(path)
    head = HFHead(hf, seed + 100)
    save_file(head.tensors, str(path / "mtp.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config[MTP_LAYERS_KEYS.get(config["architectures"][0], "mtp_num_hidden_layers")] = 1
    (path / "config.json").write_text(json.dumps(config))
    return hf, head


def saved(name: str, tmp_path_factory) -> tuple[transformers.PreTrainedModel, HFHead, str]:
    path = tmp_path_factory.mktemp(name)
    hf, head = save_with_head(name, path, seed=list({**MODELS, **NEXT_MODELS}).index(name))
    return hf, head, str(path)


@pytest.fixture(scope="module", params=["dense-lin-first", "moe-shared-full-first"])
def setup(request, tmp_path_factory):
    return saved(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A Qwen3-Next model whose layer 0 is dense (decoder_sparse_step 2), with its head."""
    return saved("next-sparse-step", tmp_path_factory)


def test_the_head_equals_transformers_layers(setup) -> None:
    """Our head over a sequence (hidden states from transformers) gives the reference's logits;
    the K/V-only pass over the first part, then the whole head over the rest, gives the same."""
    check_head(setup)


def test_qwen3_next_head_equals_transformers_layers(qwen3_next) -> None:
    check_head(qwen3_next)


def check_head(setup) -> None:
    hf, head, path = setup
    config = ModelConfig.from_hf_json(path)
    model = build_model(config)
    mtp = attach_mtp(model)
    load_weights(model, path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, 23).tolist()
    hidden = head.target_hidden(tokens)[:-1]
    want = hf.lm_head(head.run(tokens[1:], hidden))
    n = len(tokens) - 1
    attn = mtp.layers[0].self_attn
    table = torch.arange(8, dtype=torch.int32).flip(0)[None]   # blocks out of order

    def meta(start: int, end: int, cache: torch.Tensor) -> AttentionMetadata:
        pos = torch.arange(start, end)
        return AttentionMetadata(slot_mapping=table[0, pos // BS].long() * BS + pos % BS,
                                 cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                                 kv_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                                 max_q_len=end - start, is_decode=end - start == 1, kv_cache=cache)

    def new_cache() -> torch.Tensor:
        return torch.randn(1, 2, 8, BS, attn.num_kv_heads, attn.head_dim) * 3  # garbage until written

    with torch.no_grad():
        whole = model.compute_logits(mtp(torch.tensor(tokens[1:]), torch.arange(n), hidden, meta(0, n, new_cache())))
        torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
        cache, split = new_cache(), 13
        mtp.store_kv(torch.tensor(tokens[1:split + 1]), torch.arange(split), hidden[:split], meta(0, split, cache))
        rest = mtp(torch.tensor(tokens[split + 1:]), torch.arange(split, n), hidden[split:], meta(split, n, cache))
        torch.testing.assert_close(model.compute_logits(rest), want[split:], atol=1e-4, rtol=0)


def make_llm(path: str, **options: object) -> LLM:
    settings: dict[str, object] = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS,
                                       max_num_seqs=4, max_model_len=96, num_blocks=96,
                                       speculative_config={"method": "mtp", "num_speculative_tokens": K})
    llm = LLM(path, **{**settings, **options})  # type: ignore[arg-type]
    llm.engine.max_spec_backoff = 0  # random weights: drafts are mostly wrong; draft at every step anyway
    return llm


def drafting_context(engine, plan, row: int) -> list[int]:
    """The known tokens of plan row ``row``'s sequence up to its first fed one (what it drafts after)."""
    seq = next(s for s in engine.scheduler.running if s.seq_id == plan.seq_ids[row])
    return list(seq.token_ids[:int(plan.start_positions[row]) + 1])


def record_drafts(llm: LLM, truth: dict[tuple[int, ...], list[int]]) -> list[tuple[list[int], list[int]]]:
    """Wrap the MTP runner: keep each drafted row's (context, drafts the head made), then put the
    true continuation (``truth``: prompt -> greedy tokens) in place of every draft but each third,
    so verification keeps some drafts and rejects the rest (the head's own, from random weights,
    would all be rejected)."""
    runner, engine, seen = llm.engine.executor.mtp_runner, llm.engine, []
    draft = runner.draft

    def wrapped(plan, batch, inputs, upload):
        draft(plan, batch, inputs, upload)
        for row in np.flatnonzero(plan.num_drafts) if len(plan.num_drafts) else ():
            first, d = int(inputs.cu_seqlens_q[row]), int(plan.num_drafts[row])
            context = drafting_context(engine, plan, row)
            seen.append((context, batch.input_ids[first + 1:first + 1 + d].tolist()))
            prompt = next(p for p in truth if tuple(context[:len(p)]) == p)
            done = len(context) - len(prompt)
            for i, t in enumerate(truth[prompt][done:done + d]):
                if (done + i) % 3 != 2:
                    batch.input_ids[first + 1 + i] = t

    runner.draft = wrapped
    return seen


def shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 5 and 30 tokens, and two on one 22-token prefix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, 22).tolist()
    return [rng.integers(0, vocab, n).tolist() for n in (5, 30)] + [prefix + rng.integers(0, vocab, n).tolist()
                                                                   for n in (3, 7)]


@pytest.mark.parametrize("async_scheduling,padded", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "async-padded-buckets"])
def test_drafts_are_the_heads_and_tokens_are_transformers(setup, async_scheduling: bool, padded: bool) -> None:
    """Four prompts (two sharing a 22-token prefix, asked again so their second run resumes from
    a snapshot), a second turn resuming from a snapshot saved by a decode step, a 9-token budget
    and a pool that preempts, drafts partly accepted: every token is transformers', every draft
    the reference's from the same context. ``padded``: prefill, mixed and drafted steps run
    through the prefill graph runner's padded buckets (``capture=False``: what a replay runs,
    state slots and save points in its static buffers), and the drafting loop over padded rows."""
    check_drafts(setup, async_scheduling, padded)


def test_qwen3_next_drafts_are_the_heads_and_tokens_are_transformers(qwen3_next) -> None:
    check_drafts(qwen3_next, async_scheduling=False, padded=False)


def check_drafts(setup, async_scheduling: bool, padded: bool) -> None:
    hf, head, path = setup
    prompts = shared_prefix_prompts(hf.config.vocab_size, seed=5)
    want = [hf_generate(hf, p, NEW) for p in prompts]
    llm = make_llm(path, max_num_batched_tokens=9, num_blocks=14, state_snapshot_interval=2)
    llm.engine.set_async_scheduling(async_scheduling)
    ex = llm.engine.executor
    if padded:  # and the drafting loop over padded rows (2 or 4 for 1 .. 4 drafted rows)
        ex.prefill_graph_runner = ex.make_prefill_graph_runner(capture=False, buckets=[4, 9])
        ex.mtp_runner.sizes = [2, 4]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    seen = record_drafts(llm, truth)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    # A second turn on the last conversation resumes from the snapshot a decode step saved (32).
    turn = prompts[3] + want[3] + [1, 2, 3]
    truth[tuple(turn)] = hf_generate(hf, turn, NEW)
    second = llm.generate([turn], greedy, use_tqdm=False)[0]
    assert list(second.token_ids) == truth[tuple(turn)] and second.num_cached_tokens > len(prompts[3])
    warm = llm.generate(prompts[2:], greedy, use_tqdm=False)
    assert [list(o.token_ids) for o in warm] == want[2:]
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert llm.engine.stats.num_preemptions > 0
    stats = llm.engine.stats
    assert len(seen) >= 12 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for context, drafts in seen:
        assert drafts == head.drafts(context, len(drafts)), f"drafts after {len(context)} tokens"
    if padded:
        assert all(ex.prefill_graph_runner.replays_by_bucket.values()), ex.prefill_graph_runner.replays_by_bucket


def test_greedy_with_the_head_equals_greedy_without(setup) -> None:
    """A longer run at the default settings (prefix caching on, one chunk per prompt): the same
    tokens with and without the head."""
    hf, _, path = setup
    prompts = [np.random.default_rng(i).integers(0, hf.config.vocab_size, 12 + 9 * i).tolist() for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS, max_num_seqs=4,
                max_model_len=96, num_blocks=96)
    want = [list(o.token_ids) for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = make_llm(path)
    assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.stats.num_draft_tokens > 0


def test_a_model_without_the_head_is_refused(tmp_path) -> None:
    arch, settings = MODELS["dense-lin-first"]
    make_hf(arch, settings, seed=0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers 1, got 0"):
        make_llm(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers 1, got 2"):
        make_llm(str(tmp_path))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no MTP head"):  # before its ranks start
        make_llm("fixtures/tiny-qwen3", max_model_len=96, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prompt_lookup_max is for method 'ngram', not 'mtp'"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=2, prompt_lookup_max=3)
