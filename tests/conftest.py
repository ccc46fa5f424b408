"""CPU suite setup: Triton kernels run under the interpreter (no GPU here).

Triton reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when its module is
first imported, so it must be set before any test module imports minivllm.kernels.
pytest imports this conftest first in every process, pytest-xdist workers included.
"""

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

os.environ["TRITON_INTERPRET"] = "1"

# `make test` runs two xdist workers on two cores, and the TP tests spawn ranks of their
# own: torch's default of one OpenMP thread per core oversubscribes the CPU, and spinning
# OpenMP threads slowed single tests 40x (a 1 s test took 47 s beside a TP test). One
# thread per process; spawned ranks inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _patch_the_language_once_per_launch(interpreter: ModuleType) -> None:
    """Triton's interpreter patches ``triton.language`` when a kernel launches and restores it
    when the launch ends, but patches it again at every call of a ``@triton.jit`` helper
    inside the kernel (``inspect.getmembers`` over the language modules, ~1.5 ms a call):
    kernels that call a helper per tile spent half their time there. A helper whose
    language modules are patched already (by the running launch, or by an earlier helper
    of it that brought another one) now runs under that patch, which is the same one; the
    first helper with another module patches it as before."""
    real_patch_lang = interpreter._patch_lang
    language = (interpreter.tl, interpreter.tl.core)
    patched = threading.local()  # .langs: ids of the language modules patched in this thread's launch
    langs_of: dict[Callable, frozenset[int]] = {}

    class Patch:
        def __init__(self, scope: Any, covered: frozenset[int]) -> None:
            self.scope, self.outer = scope, getattr(patched, "langs", frozenset())
            patched.langs = covered

        def restore(self) -> None:
            self.scope.restore()
            patched.langs = self.outer

    class AlreadyPatched:
        def restore(self) -> None:
            pass

    def patch_lang(fn: Callable) -> Patch | AlreadyPatched:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in language)
        langs, covered = langs_of[fn], getattr(patched, "langs", frozenset())
        if langs and langs <= covered:
            return AlreadyPatched()
        return Patch(real_patch_lang(fn), covered | langs)

    interpreter._patch_lang = patch_lang
    interpreter._patched_once_per_launch = True


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Installs the patch above in a process that has imported Triton's interpreter (the
    engine and simulator tests never import it); an interpreter without ``_patch_lang`` and ``tl``
    (another Triton) runs as it is. Without the patch the kernel tests took 58 s, with it 39
    (``pytest -n 2 tests/kernels``, 2 cores, Triton 3.9)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if (interpreter is not None and hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "tl")
            and not getattr(interpreter, "_patched_once_per_launch", False)):
        _patch_the_language_once_per_launch(interpreter)


@pytest.fixture(scope="module")
def gguf_parsed_once() -> Iterator[None]:
    """Each GGUF file's header parsed once in the test module: minivllm's loader,
    transformers' tokenizer and transformers' model each build a ``gguf.GGUFReader`` of the
    file, which takes ~8 s for SmolLM2's 49k-token vocabulary, and transformers builds gguf's
    tensor name map once per module of the model (~9 s in all). Both only read: one of each
    serves every caller, who still converts and checks what it reads on its own."""
    import gguf

    real_reader = gguf.GGUFReader
    readers: dict[tuple, gguf.GGUFReader] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_ino, st.st_mtime_ns, st.st_size)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
