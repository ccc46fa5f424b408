"""Load a Hugging Face safetensors checkpoint through each parameter's ``weight_loader``.

Checkpoint names map onto our modules by name, except the packed ones
(``model.packed_modules_mapping``)::

    model.layers.3.self_attn.k_proj.weight -> model.layers.3.self_attn.qkv_proj.weight, shard "k"
    model.layers.3.mlp.up_proj.weight      -> model.layers.3.mlp.gate_up_proj.weight,   shard 1

Strict: after reading every tensor, each parameter must have received exactly
the shards it expects. Missing, unexpected, duplicated and mis-shaped tensors
are all collected and reported together in one ``ValueError``.

One deliberate exception, stated here so nothing is skipped silently: with
tied embeddings the head *is* the embedding, so an ``lm_head.weight`` stored
anyway (some exporters write the copy) is not loaded a second time.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Mapping, Protocol

import torch
from safetensors import safe_open
from torch import nn

from minivllm.layers.linear import ShardId, get_shard_ids, get_weight_loader

INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"


class LoadableModel(Protocol):
    """What the loader needs from a model."""

    packed_modules_mapping: Mapping[str, tuple[str, ShardId]]
    tie_word_embeddings: bool

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


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


def iter_checkpoint(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every checkpoint file, on the CPU."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def map_name(name: str, packed: Mapping[str, tuple[str, ShardId]]) -> tuple[str, ShardId]:
    """Checkpoint tensor name -> (our parameter name, shard id)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            module, shard_id = packed[part]
            return ".".join(parts[:i] + [module] + parts[i + 1:]), shard_id
    return name, None


def load_weights(model: LoadableModel, path: str | os.PathLike[str]) -> None:
    """Fill every parameter of ``model`` from the safetensors checkpoint in ``path``.

    Args:
        model: a model with ``packed_modules_mapping`` and ``tie_word_embeddings``.
        path: a directory with ``*.safetensors`` (and ``model.safetensors.index.json``
            when sharded).

    Raises:
        FileNotFoundError: no checkpoint files.
        ValueError: listing every missing, unexpected, duplicated or mis-shaped tensor.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[ShardId]] = {name: set() for name in params}
    unexpected: list[str] = []
    bad: list[str] = []
    for ckpt_name, tensor in iter_checkpoint(path):
        if model.tie_word_embeddings and ckpt_name == TIED_HEAD:
            continue  # the head shares the embedding (see the module docstring)
        name, shard_id = map_name(ckpt_name, model.packed_modules_mapping)
        if name not in params:
            unexpected.append(ckpt_name)
            continue
        if shard_id in loaded[name]:
            bad.append(f"{ckpt_name}: appears more than once")
            continue
        try:
            get_weight_loader(params[name])(params[name], tensor, shard_id)
        except ValueError as e:
            bad.append(f"{ckpt_name} -> {name}: {e}")
            continue
        loaded[name].add(shard_id)
    missing = _missing_shards(params, loaded, model.packed_modules_mapping)
    _raise_if_any(path, missing, unexpected, bad)


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
                  bad: list[str]) -> None:
    if not (missing or unexpected or bad):
        return
    lines = [f"checkpoint {os.fspath(path)} does not match the model:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped or invalid", bad)):
        if names:
            lines.append(f"  {title} ({len(names)}):")
            lines.extend(f"    {n}" for n in names)
    raise ValueError("\n".join(lines))
