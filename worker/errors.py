"""Failures a rank reports as one sentence: the operator's set-up is wrong, not the code."""


class WorkerFatal(Exception):
    """The rank cannot serve this engine (the message says why); it reports and exits
    without a traceback, which would only bury the reason."""
