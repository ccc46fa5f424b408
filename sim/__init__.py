"""The CPU simulator: the real engine driven by a fake numpy model (never imports torch).

- ``fake_executor``: ``FakeExecutor`` and ``fake_next_token`` (``docs/design.md``, "The simulator").
- ``oracle``: what each request must produce, computed without paging or batching.
- ``traces``: the random trace generator (the JSONL format and the recorder of live traffic
  are the engine's: ``minivllm.engine.trace``).
- ``runner``: runs a trace through ``LLMEngine`` and checks every step; record / replay (a
  recorded live trace replays on its recorded tokens).
- ``plot``: pictures of a run (matplotlib, imported only when drawing).
- ``__main__``: ``python -m sim run | record | replay``.
"""
