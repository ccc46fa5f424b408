"""Model building blocks: tensor-parallel linear layers, norms, rotary embedding,
activation, vocab-parallel embedding / LM head, paged attention and the sampler.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``
that copies this rank's shard of a checkpoint tensor into it (see ``linear.py``);
the model loader goes through it and nothing else.
"""
