"""GGUF checkpoints (llama.cpp's one-file format), dequantized at load.

Reader: the ``gguf`` package (gguf-py, kept in the llama.cpp repository beside the
format's definition): ``GGUFReader`` memory-maps the file and hands out each tensor's
raw quantized rows; ``gguf.quants.dequantize`` turns rows into float32. Chosen over
transformers' GGUF loading, which dequantizes the whole file into one state dict (and
needs ``accelerate``) before anything can be checked: here tensors go one at a time
through the loader's ``weight_loader``s and its strict every-weight checks, a
tensor-parallel rank dequantizes only its rows of a row-sharded tensor, and
transformers' own GGUF path stays an independent reference for the tests.

Everything GGUF-specific lives here, in three pieces:

- ``hf_config(path)``: the metadata as a Hugging Face ``config.json`` dict, which
  ``ModelConfig.from_hf_dict`` (the one config reader) turns into our ``ModelConfig``
  (``minivllm.model.hf_config.read_model_config``);
- ``iter_gguf(path)``: the tensors under their Hugging Face names, for ``load_weights``;
- ``load_gguf_tokenizer(path)``: transformers' tokenizer built from the ``tokenizer.*``
  metadata (vocabulary, merges, special ids, chat template).

What loads: architecture ``llama`` (-> ``LlamaForCausalLM``; SmolLM2 and Llama 3.x
without frequency scaling), tensors of the types in ``SUPPORTED_TYPES``. What is
refused with a ``ValueError`` naming it: any other architecture or tensor type,
mixture-of-experts files, a ``rope_freqs`` tensor (llama.cpp's form of Llama 3.1's
frequency scaling), and what ``ModelConfig.from_hf_dict`` refuses (partial rotary,
RoPE scaling types it does not implement).

llama.cpp's converter reorders the rows of Llama's q and k projections within every
head, from Hugging Face's rotate-half RoPE layout to GGML's adjacent pairs;
``unpermute_rows`` undoes that, so the model sees the Hugging Face layout.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

if TYPE_CHECKING:
    import gguf  # imported where a GGUF file is read: a safetensors checkpoint needs no gguf package
    import torch

GGUF_SUFFIX = ".gguf"
# GGUF general.architecture -> our architecture name (minivllm.config.SUPPORTED_ARCHITECTURES).
ARCHITECTURES: Mapping[str, str] = {"llama": "LlamaForCausalLM"}
# Architectures whose converter permutes the q/k rows (see the module docstring).
_PERMUTED_QK = frozenset({"llama"})
# The float types and llama.cpp's legacy and k-quant types (``gguf.GGMLQuantizationType``
# names): what the common llama.cpp file types (F16, Q4_0 .. Q8_0, Q2_K .. Q6_K and their
# mixes) are made of.
SUPPORTED_TYPES: frozenset[str] = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})
# Per-layer GGUF tensor name -> Hugging Face module path inside model.layers.N.
_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: Mapping[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                                    "output": "lm_head"}
# Token ids that end a generation in llama.cpp (its "end of generation" set), in this order.
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


_MISSING = object()  # "no default": an absent metadata key is an error


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file named ``*.gguf``."""
    return os.path.isfile(path) and os.fspath(path).endswith(GGUF_SUFFIX)


def find_gguf(directory: str) -> str | None:
    """The one GGUF file of a checkpoint directory that holds no safetensors, else None
    (a directory with ``*.safetensors`` is a Hugging Face checkpoint, whatever else it holds).

    Raises:
        ValueError: several GGUF files (the message lists them): which one is meant is unclear.
    """
    if glob.glob(os.path.join(directory, "*.safetensors")):
        return None
    files = sorted(glob.glob(os.path.join(directory, "*" + GGUF_SUFFIX)))
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise ValueError(f"model directory {directory!r} holds {len(files)} GGUF files ({names}); "
                         "pass the path of the one to load")
    return files[0] if files else None


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """A reader of ``path`` whose architecture and tensor types are supported. The last
    file's reader is kept (while the file keeps its size and modification time), so that a
    load's config and its weights parse the file's header once: seconds for a file with a
    large vocabulary.

    Raises:
        ValueError: not a readable GGUF file, an unsupported architecture, or tensors of
            unsupported types (each type named, with the tensors that use it).
    """
    try:
        st = os.stat(path)
        reader = _reader(os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{os.fspath(path)}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch = _value(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{os.fspath(path)}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {tuple(ARCHITECTURES)}")
    unsupported: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            unsupported.setdefault(t.tensor_type.name, []).append(t.name)
    if unsupported:
        found = "; ".join(f"{kind} ({len(names)} tensors, e.g. {names[0]})"
                          for kind, names in sorted(unsupported.items()))
        raise ValueError(f"{os.fspath(path)}: unsupported GGUF tensor type(s): {found}; supported: "
                         f"{sorted(SUPPORTED_TYPES)}")
    return reader


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    """``gguf.GGUFReader(path)``, memoised by the file's identity (``open_gguf``)."""
    import gguf

    return gguf.GGUFReader(path)


def hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of GGUF file ``path`` as a Hugging Face ``config.json`` dict.

    Raises:
        ValueError: what ``open_gguf`` refuses, a missing metadata key, a
            mixture-of-experts model, or a ``rope_freqs`` tensor.
    """
    reader = open_gguf(path)
    arch = _value(reader, "general.architecture", path)

    def get(key: str, default: Any = _MISSING) -> Any:
        return _value(reader, f"{arch}.{key}", path, default)

    if get("expert_count", 0):
        raise ValueError(f"{os.fspath(path)}: mixture-of-experts GGUF ({arch}.expert_count = "
                         f"{get('expert_count')}) is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{os.fspath(path)}: tensor rope_freqs.weight (frequency-scaled RoPE, as "
                         "llama.cpp writes Llama 3.1) is not supported")
    heads = get("attention.head_count")
    head_dim = _head_dim(reader, arch, path)
    rope: dict[str, Any] = {"rope_theta": float(get("rope.freq_base", 10_000.0))}
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:  # from_hf_json refuses partial rotary by this key
        rope["partial_rotary_factor"] = rotary / head_dim
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":  # from_hf_json refuses the types it does not implement
        rope["rope_type"] = scaling
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", None) if tokens is None else get("vocab_size", len(tokens.data))
    if vocab is None:
        raise ValueError(f"{os.fspath(path)}: GGUF metadata has neither {arch}.vocab_size nor "
                         "tokenizer.ggml.tokens")
    eos = [i for key in _EOS_KEYS if (i := _value(reader, key, path, None)) is not None]
    return {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": get("context_length"),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": list(dict.fromkeys(eos)) or None,
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id", path, None),
    }


def _head_dim(reader: gguf.GGUFReader, arch: str, path: str | os.PathLike[str]) -> int:
    """``{arch}.attention.key_length``, by default ``embedding_length / head_count`` (as in
    llama.cpp)."""
    heads = _value(reader, f"{arch}.attention.head_count", path)
    return _value(reader, f"{arch}.attention.key_length", path, None) or \
        _value(reader, f"{arch}.embedding_length", path) // heads


def _value(reader: gguf.GGUFReader, key: str, path: str | os.PathLike[str], default: Any = _MISSING) -> Any:
    """Metadata value ``key`` (``default`` when absent; absent without a default: ValueError)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"{os.fspath(path)}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def hf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face name (``blk.3.attn_k.weight`` ->
    ``model.layers.3.self_attn.k_proj.weight``); a name we do not know is kept, so the
    loader reports it as unexpected under the name the file uses."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return name


def unpermute_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order on whole heads of rows (``(H * head_dim, ...)``).

    Within a head, the file's row ``2 * j + i`` is Hugging Face's row ``i * head_dim / 2 + j``
    (``i`` in {0, 1}: the two halves that rotate-half RoPE pairs).
    """
    rest = rows.shape[1:]
    # (H, head_dim/2, 2, ...) -> (H, 2, head_dim/2, ...)
    return rows.reshape(-1, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


class GGUFTensor:
    """One GGUF tensor under its Hugging Face name, dequantized to float32 only as far
    as a weight loader reads it (satisfies ``minivllm.layers.linear.CheckpointTensor``).

    Rows are the unit of quantization blocks, so ``narrow`` along dim 0 dequantizes
    only those rows (for permuted q/k rows: when the range covers whole heads).

    Attributes:
        name: the Hugging Face name. shape: the Hugging Face (row-major) shape.
        numel_read: elements dequantized so far.
    """

    def __init__(self, tensor: Any, name: str, permuted_head_dim: int | None) -> None:
        import torch

        self._tensor = tensor
        self._head_dim = permuted_head_dim
        self.name = name
        # GGUF lists dimensions fastest first (ne0 = columns); torch lists them slowest first.
        self.shape = torch.Size(int(d) for d in reversed(tensor.shape.tolist()))
        self.numel_read = 0

    @property
    def dtype(self) -> "torch.dtype":
        """float32: what every type dequantizes to (the parameter's copy casts it)."""
        import torch
        return torch.float32

    def narrow(self, dim: int, start: int, length: int) -> "torch.Tensor":
        """``[start, start + length)`` along ``dim`` (like ``torch.Tensor.narrow``).

        Raises:
            ValueError: ``dim`` or the range is outside the tensor.
        """
        from minivllm.layers.weights import check_narrow

        check_narrow(self.name, self.shape, dim, start, length)
        whole_heads = self._head_dim is None or (start % self._head_dim == 0 and length % self._head_dim == 0)
        if dim == 0 and len(self.shape) > 1 and whole_heads:
            return self._rows(start, length)
        return self.read().narrow(dim, start, length)

    def read(self) -> "torch.Tensor":
        """The whole tensor."""
        return self._rows(0, self.shape[0]) if len(self.shape) > 1 else self._all()

    def _rows(self, start: int, length: int) -> "torch.Tensor":
        # data: (rows, bytes or elements per row); a quantized row holds whole blocks.
        from gguf.quants import dequantize

        rows = dequantize(self._tensor.data[start:start + length], self._tensor.tensor_type)
        return self._finish(rows.reshape(length, *self.shape[1:]))

    def _all(self) -> "torch.Tensor":
        from gguf.quants import dequantize

        values = dequantize(self._tensor.data, self._tensor.tensor_type)
        return self._finish(values.reshape(self.shape))

    def _finish(self, values: np.ndarray) -> "torch.Tensor":
        import torch

        if self._head_dim is not None:
            values = unpermute_rows(values, self._head_dim)
        self.numel_read += values.size
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only


def iter_gguf(path: str | os.PathLike[str]) -> Iterator[GGUFTensor]:
    """Every tensor of GGUF file ``path`` under its Hugging Face name, not yet dequantized.

    Raises:
        ValueError: what ``open_gguf`` refuses.
    """
    reader = open_gguf(path)
    arch = _value(reader, "general.architecture", path)
    head_dim = _head_dim(reader, arch, path)
    for t in reader.tensors:
        permuted = arch in _PERMUTED_QK and t.name.split(".")[2:3] in (["attn_q"], ["attn_k"])
        yield GGUFTensor(t, hf_name(t.name), head_dim if permuted else None)


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """transformers' tokenizer built from GGUF file ``path`` (with its chat template and
    special tokens).

    Raises:
        ValueError: transformers cannot build a tokenizer from the file's metadata.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    except Exception as e:  # transformers raises ValueError, KeyError, OSError... per tokenizer kind
        raise ValueError(f"{path}: no tokenizer could be built from the GGUF metadata "
                         f"({type(e).__name__}: {e})") from e
