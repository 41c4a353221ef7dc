"""The worker: model, KV cache tensors, attention, sampler and the step executor.

`ModelRunner` (worker/model_runner.py) is the entry point the process loop drives.
"""
