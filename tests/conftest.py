"""CPU suite setup: Triton kernels run under the interpreter (no GPU here).

Triton reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when its module is
first imported, so it must be set before any test module imports minivllm.kernels.
pytest imports this conftest first in every process, pytest-xdist workers included.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
