"""The worker: model, KV cache tensors, attention, sampler and the step executor.

`ModelRunner` (worker/model_runner.py) is the entry point the process loop drives.
"""

import os

# The worker shares the host's cores with the scheduler and frontend processes.
# OpenMP's default busy-wait between parallel regions then fights them for the
# CPU (measured: decode steps 4-6x slower on 2 busy cores); passive waiting
# costs little when the machine is idle. Only effective before torch is
# imported, which is the case in `python -m noria.worker`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Transparent huge pages for torch's CPU allocations of 2 MB and more (the KV
# cache, the weights): decode reads K/V through scattered blocks, and with 4 KB
# pages a TLB miss lands on nearly every block. Measured on W1's replayed steps:
# about 5 % faster. Most kernels only honour THP for regions that ask for it
# (`enabled = madvise`), which is what this makes torch do.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
