"""The worker: model, KV cache tensors, attention, sampler and the step executor.

`ModelRunner` (worker/model_runner.py) is the entry point the process loop drives.
"""

import os

# The worker shares the host's cores with the scheduler and frontend processes.
# OpenMP's default busy-wait between parallel regions then fights them for the
# CPU (measured: decode steps 4-6x slower on 2 busy cores); passive waiting
# costs little when the machine is idle. Only effective before torch is
# imported, which is the case in `python -m worker`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
