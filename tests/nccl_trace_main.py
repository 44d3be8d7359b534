"""Run a script with this process's torch.distributed calls recorded (`nccl_order`).

    python tests/nccl_trace_main.py SCRIPT [ARGS...]

runs SCRIPT as ``python SCRIPT ARGS`` would (as ``__main__``, its directory first on the path),
after `nccl_order.install` with the directory named by ``MEGATRON_KTO_NCCL_TRACE``; the trace is
written when the process exits. `e2e_cli.launch` starts every multi-rank run of the entry scripts
through it, so the recorder stays on the test side: no hook in library code.
"""

import os
import runpy
import sys
from pathlib import Path

import nccl_order

if __name__ == "__main__":
    nccl_order.install(os.environ[nccl_order.TRACE_ENV])  # before megatron-core is imported
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
