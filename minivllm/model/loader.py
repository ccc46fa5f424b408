"""Load a Hugging Face safetensors checkpoint through each parameter's ``weight_loader``.

Checkpoint names map onto our modules by name, except the packed ones
(``model.packed_modules_mapping``)::

    model.layers.3.self_attn.k_proj.weight -> model.layers.3.self_attn.qkv_proj.weight, shard "k"
    model.layers.3.mlp.up_proj.weight      -> model.layers.3.mlp.gate_up_proj.weight,   shard 1

Strict: after reading every tensor, each parameter must have received exactly
the shards it expects. Missing, unexpected, duplicated and mis-shaped tensors
are all collected and reported together in one ``ValueError``, which names the
tensor-parallel rank when there is more than one.

Sliced: a weight loader gets a ``LazyTensor`` (the tensor's place in the open
file) and reads only its rank's slice of it, so with N ranks each process reads
about 1/N of the sharded weights (and all of the small replicated ones) instead
of the whole checkpoint. ``load_weights`` returns how much it read.

One deliberate exception, stated here so nothing is skipped silently: with
tied embeddings the head *is* the embedding, so an ``lm_head.weight`` stored
anyway (some exporters write the copy) is not loaded a second time. A model may
also name tensors it does not serve (``skip_reason``: Qwen3.5's vision tower and
MTP head); they are skipped by name and logged once per reason, with their count.

Names: a model may rename a checkpoint's tensors, or split one into parts, before the packing
rules apply (``checkpoint_parts``: Qwen3.5's ``model.language_model.`` prefix, Qwen3-Next's
fused DeltaNet projections read as Qwen3.5's four). Experts stored
stacked (``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I),
as Qwen3.5-MoE checkpoints keep them) are read whole and loaded as the per-expert
tensors they stack.

``fill_dummy_weights`` is the checkpoint-free alternative (``load_format="dummy"``):
random values of a trained model's scale, drawn on the device.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

import torch
from safetensors import safe_open
from torch import nn

from minivllm.config import FP8_WEIGHT_BLOCK
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.moe import expert_shard
from minivllm.layers.norm import RMSNorm
from minivllm.layers.weights import Loaded, ShardId, check_narrow, get_shard_ids, get_weight_loader, read_whole
from minivllm.model.gguf import GGUFTensor, is_gguf_file, iter_gguf
from minivllm.ops.dispatch import FP8_DTYPE, quantize_fp8_block

INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"
# Stacked experts' tensor names (the name's last two parts) -> the projections they stack, in
# the order of their rows.
STACKED_EXPERTS: Mapping[str, tuple[str, ...]] = {
    "experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}

logger = logging.getLogger(__name__)

# safetensors dtype names -> torch dtypes (the ones Qwen3 checkpoints use, and a few more).
_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}


class LoadableModel(Protocol):
    """What the loader needs from a model."""

    packed_modules_mapping: Mapping[str, tuple[str, ShardId]]
    tie_word_embeddings: bool

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def skip_reason(self, name: str) -> str | None:
        """Why the checkpoint tensor ``name`` is not loaded, or None: it is."""
        ...

    def checkpoint_parts(self, name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
        """The checkpoint tensor ``name`` as the model's modules spell it (before packing): one
        ``(name, tensor)`` pair, or the parts it fuses."""
        ...


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint directory (from the index when sharded).

    Raises:
        FileNotFoundError: no safetensors file, or a file the index names is absent.
    """
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FileNotFoundError(f"{index} names missing file(s): {absent}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    return files


def require_weights(path: str | os.PathLike[str]) -> None:
    """Check that ``path`` holds weights to load (a ``.gguf`` file, or safetensors files),
    before a model is built for them.

    Raises:
        ValueError: no weights; the message names the path, the files looked for and
            ``load_format="dummy"`` (random weights, no files needed).
    """
    if is_gguf_file(path):
        return
    try:
        checkpoint_files(path)
    except FileNotFoundError as e:
        raise ValueError(f"no model weights to load: {e} (looked for *.safetensors or {INDEX_FILE}); "
                         "pass load_format='dummy' to run on random weights without them") from e


class LazyTensor:
    """One tensor of an open safetensors file, read only as far as a weight loader asks.

    Satisfies ``minivllm.layers.linear.CheckpointTensor``. Valid while its file is
    open, i.e. until ``iter_checkpoint`` yields the next tensor.

    Attributes:
        name: the checkpoint tensor name.
        shape: its full shape (from the file header; nothing is read).
        numel_read: elements read so far through ``narrow`` and ``read``.
    """

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())
        self.numel_read = 0

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype."""
        stored = self._slice.get_dtype()
        if stored in _DTYPES:
            return _DTYPES[stored]
        return self.narrow(0, 0, 0).dtype if self.shape else self.read().dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start + length)`` along ``dim`` (like ``torch.Tensor.narrow``).

        Raises:
            ValueError: ``dim`` or the range is outside the tensor.
        """
        check_narrow(self.name, self.shape, dim, start, length)
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._count(self._slice[index])

    def read(self) -> torch.Tensor:
        """Read the whole tensor."""
        return self._count(self._handle.get_tensor(self.name))

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.numel_read += t.numel()
        return t


def iter_checkpoint(path: str | os.PathLike[str]) -> Iterator[LazyTensor | GGUFTensor]:
    """Yield every tensor of every checkpoint file, unread (a ``LazyTensor`` on the CPU);
    for a GGUF file, its tensors under their Hugging Face names (``minivllm.model.gguf``)."""
    if is_gguf_file(path):
        yield from iter_gguf(path)
        return
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield LazyTensor(f, name)


def map_name(name: str, packed: Mapping[str, tuple[str, ShardId]]) -> tuple[str, ShardId]:
    """Checkpoint tensor name -> (our parameter name, shard id). An expert's tensor goes to
    the stacked experts (``layers/moe.py``)::

        model.layers.0.mlp.experts.3.up_proj.weight -> model.layers.0.mlp.experts.gate_up_proj, (3, 1)
    """
    parts = name.split(".")
    expert = expert_shard(parts)
    if expert is not None:
        i, stacked, shard_id = expert
        return ".".join(parts[:i + 1] + [stacked]), shard_id
    for i, part in enumerate(parts):
        if part in packed:
            module, shard_id = packed[part]
            return ".".join(parts[:i] + [module] + parts[i + 1:]), shard_id
    return name, None


@dataclass(frozen=True)
class LoadReport:
    """What ``load_weights`` read.

    Attributes:
        num_tensors: tensors in the checkpoint.
        numel_total: their elements.
        numel_read: elements this process read (its shards, and replicated tensors whole).
    """

    num_tensors: int
    numel_total: int
    numel_read: int


def load_weights(model: LoadableModel, path: str | os.PathLike[str], *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> LoadReport:
    """Fill every parameter of ``model`` (this rank's shards) from the checkpoint in ``path``.

    Each parameter's ``weight_loader`` reads only its rank's slice of each tensor.

    Args:
        model: a model with ``packed_modules_mapping`` and ``tie_word_embeddings``.
        path: a directory with ``*.safetensors`` (and ``model.safetensors.index.json``
            when sharded), or a ``.gguf`` file (dequantized as read).
        tp_rank, tp_size: named in errors; by default taken from the model's layers
            (their ``tp_rank``/``tp_size``; 0 and 1 when it has none).

    Returns:
        How many tensors and elements the checkpoint holds and how many were read.

    Raises:
        FileNotFoundError: no checkpoint files.
        ValueError: listing every missing, unexpected, duplicated or mis-shaped tensor
            (and the rank, when ``tp_size > 1``).
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[ShardId]] = {name: set() for name in params}
    unexpected: list[str] = []
    bad: list[str] = []
    skipped: Counter[str] = Counter()
    num_tensors = numel_total = numel_read = 0
    for tensor in iter_checkpoint(path):
        ckpt_name = tensor.name
        num_tensors += 1
        numel_total += tensor.shape.numel()
        if model.tie_word_embeddings and ckpt_name == TIED_HEAD:
            continue  # the head shares the embedding (see the module docstring)
        reason = model.skip_reason(ckpt_name)
        if reason is not None:
            skipped[reason] += 1
            continue
        for name_in, part in _model_parts(model, ckpt_name, tensor):
            name, shard_id = map_name(name_in, model.packed_modules_mapping)
            if name not in params:
                unexpected.append(ckpt_name)
                continue
            if shard_id in loaded[name]:
                bad.append(f"{ckpt_name}: appears more than once")
                continue
            try:
                get_weight_loader(params[name])(params[name], part, shard_id)
            except ValueError as e:
                bad.append(f"{ckpt_name} -> {name}: {e}")
                continue
            loaded[name].add(shard_id)
        numel_read += tensor.numel_read
    for reason, count in skipped.items():
        logger.info("skipped %d checkpoint tensor(s) of %s: %s", count, os.fspath(path), reason)
    missing = _missing_shards(params, loaded, model.packed_modules_mapping)
    rank, size = _tp_of(model) if tp_rank is None or tp_size is None else (tp_rank, tp_size)
    _raise_if_any(path, missing, unexpected, bad, rank, size)
    return LoadReport(num_tensors, numel_total, numel_read)


def _model_parts(model: LoadableModel, name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
    """The checkpoint tensor ``name`` as the tensors the model's parameters take: renamed or
    split by the model (``checkpoint_parts``), stacked experts unstacked."""
    for part_name, part in model.checkpoint_parts(name, tensor):
        yield from _unstacked(part_name, part)


def _unstacked(name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
    """``(name, tensor)``, or for stacked experts (``STACKED_EXPERTS``) the per-expert tensors
    they stack, under the names a per-expert checkpoint gives them (the whole tensor read once)::

        model.layers.0.mlp.experts.gate_up_proj (E, 2I, H) -> model.layers.0.mlp.experts.{e}.gate_proj.weight
                                                              (rows [0, I)), ...up_proj.weight (rows [I, 2I))
    """
    parts = name.split(".")
    projections = STACKED_EXPERTS.get(".".join(parts[-2:]))
    if projections is None or len(tensor.shape) != 3:
        yield name, tensor
        return
    whole = read_whole(tensor)
    rows = whole.shape[1] // len(projections)
    for e in range(whole.shape[0]):
        for i, projection in enumerate(projections):
            yield ".".join(parts[:-1] + [str(e), projection, "weight"]), whole[e, i * rows:(i + 1) * rows]


def _tp_of(model: LoadableModel) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of the model's tensor-parallel layers; ``(0, 1)`` without any."""
    modules = model.modules() if isinstance(model, nn.Module) else [model]
    found = {(m.tp_rank, m.tp_size) for m in modules if hasattr(m, "tp_rank") and hasattr(m, "tp_size")}
    if len(found) > 1:
        raise ValueError(f"the model's layers disagree on (tp_rank, tp_size): {sorted(found)}")
    return found.pop() if found else (0, 1)


def _missing_shards(params: Mapping[str, nn.Parameter], loaded: Mapping[str, set[ShardId]],
                    packed: Mapping[str, tuple[str, ShardId]]) -> list[str]:
    """Every (parameter, shard) never written, named by the checkpoint tensor it wanted."""
    missing = []
    for name, param in params.items():
        for shard_id in get_shard_ids(param):
            if shard_id not in loaded[name]:
                missing.append(name if shard_id is None else _unpacked_name(name, shard_id, packed))
    return missing


def _unpacked_name(name: str, shard_id: ShardId, packed: Mapping[str, tuple[str, ShardId]]) -> str:
    parts = name.split(".")
    for ckpt_module, (module, sid) in packed.items():
        if sid == shard_id and module in parts:
            i = parts.index(module)
            return ".".join(parts[:i] + [ckpt_module] + parts[i + 1:]) + f" (-> {name} shard {shard_id!r})"
    return f"{name} (shard {shard_id!r})"


def _raise_if_any(path: str | os.PathLike[str], missing: list[str], unexpected: list[str],
                  bad: list[str], tp_rank: int, tp_size: int) -> None:
    if not (missing or unexpected or bad):
        return
    where = f" (tensor-parallel rank {tp_rank} of {tp_size})" if tp_size > 1 else ""
    lines = [f"checkpoint {os.fspath(path)} does not match the model{where}:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped or invalid", bad)):
        if names:
            lines.append(f"  {title} ({len(names)}):")
            lines.extend(f"    {n}" for n in names)
    raise ValueError("\n".join(lines))


# The std of a random matrix: Hugging Face's ``initializer_range`` default, the scale a
# model starts training from. With unit RMSNorm weights, q.k and the logits then come
# out of order 1 at hidden sizes of 1-8k, so attention and sampling see varied
# distributions; vLLM's uniform(-1e-3, 1e-3) makes every logit nearly equal instead.
DUMMY_STD = 0.02


def fill_dummy_weights(model: nn.Module, seed: int) -> int:
    """Fill every parameter of ``model`` in place, on its device and in its dtype, with
    random weights (``load_format="dummy"``); nothing is read and nothing passes through
    host memory.

    Norm weights are 1, biases 0, every other matrix normal(0, ``DUMMY_STD``), and a
    parameter a checkpoint may omit keeps its default (KV cache scales: 1.0); the
    vocabulary shards' padding rows are zeroed as ``load_weights`` zeroes them. Each
    parameter draws from its own generator, seeded from ``seed`` and its name, so the
    values depend on neither the order nor the number of parameters, and are the same
    for the same seed on the same kind of device. Tensor parallelism: every rank draws
    the same values for a parameter of a given name, so replicated parameters agree;
    each rank's shard of a sharded one then holds the same values as the other ranks'
    (a valid model of the same shapes, but not a split of the one-rank dummy model).
    Tied embeddings stay tied (the shared tensor is filled once).

    Returns:
        The number of parameters filled.

    Raises:
        ValueError: a parameter that is not a floating-point norm weight, bias or matrix
            (no rule says what its random value should be).
    """
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for short, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # a tied weight, filled under its first name
            seen.add(id(param))
            name = f"{module_name}.{short}" if module_name else short
            _fill_dummy(module, short, name, param, seed)
    return len(seen)


def _fill_dummy(module: nn.Module, short: str, name: str, param: nn.Parameter, seed: int) -> None:
    if not param.dtype.is_floating_point:
        raise ValueError(f"{name}: no dummy fill for a {param.dtype} parameter")
    with torch.no_grad():
        if hasattr(param, "fill_value"):  # a checkpoint may omit it: its default (KV cache scales)
            param.fill_(param.fill_value)
        elif getattr(param, "is_block_scale", False):
            pass  # filled with its weight (below), which comes first
        elif param.dtype == FP8_DTYPE:  # e4m3 weights: random values quantized in 128 x 128 blocks
            scale = module.block_scale_of(param)
            generator = _dummy_generator(seed, name, param.device)
            for i, (q, s) in enumerate(zip(param.view(-1, *param.shape[-2:]), scale.view(-1, *scale.shape[-2:]))):
                w = torch.empty(q.shape, dtype=torch.float32, device=param.device).normal_(0.0, DUMMY_STD,
                                                                                         generator=generator)
                # One matrix at a time (an expert's): a bounded temporary.
                q8, s8 = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
                q.copy_(q8)
                s.copy_(s8)
        elif isinstance(module, RMSNorm):
            param.fill_(1.0)
        elif short == "bias":
            param.zero_()
        elif param.dim() >= 2:
            param.normal_(0.0, DUMMY_STD, generator=_dummy_generator(seed, name, param.device))
            if isinstance(module, VocabParallelEmbedding):
                param[module.vocab_end - module.vocab_start:].zero_()
        else:
            raise ValueError(f"{name}: no dummy fill rule for a {tuple(param.shape)} parameter "
                             f"of {type(module).__name__} (norm weights, biases and matrices have one)")


def _dummy_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from (``seed``, ``name``); blake2b, not ``hash()``,
    whose value changes from one process to the next."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator
