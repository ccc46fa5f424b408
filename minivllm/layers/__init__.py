"""Model building blocks: tensor-parallel linear layers, norms, rotary embedding,
vocab-parallel embedding / LM head, paged attention, experts. They hold weights; what runs
on them is chosen by the dispatch point (``minivllm/ops/``).

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
that copies this rank's shard of a checkpoint tensor into it (see ``linear.py``);
the model loader goes through it and nothing else.
"""
