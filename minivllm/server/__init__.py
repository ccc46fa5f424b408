"""The OpenAI-compatible HTTP server: ``python -m minivllm serve MODEL``.

``protocol`` holds the request/response models, ``engine_loop`` the thread that
steps the engine for asyncio handlers, ``app`` the FastAPI routes. Needs the
``serve`` extra (fastapi, uvicorn, pydantic); importing this package imports none.
"""
