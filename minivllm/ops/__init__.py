"""The one road from the model's layers to the kernels.

``dispatch.Ops`` says, for every fused op, which implementation runs (our Triton kernels or
their torch references), whether launches use PDL, and which communicator tensor parallelism
uses (``communicator.Communicator``). The executor builds one per engine and hands it to the
model; layers hold weights and call ``Ops``, never a kernel or a reference directly.
"""
