"""CPU suite setup: Triton kernels run under the interpreter (no GPU here).

Triton reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when its module is
first imported, so it must be set before any test module imports minivllm.kernels.
pytest imports this conftest first in every process, pytest-xdist workers included.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

# `make test` runs two xdist workers on two cores, and the TP tests spawn ranks of their
# own: torch's default of one OpenMP thread per core oversubscribes the CPU, and spinning
# OpenMP threads slowed single tests 40x (a 1 s test took 47 s beside a TP test). One
# thread per process; spawned ranks inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
