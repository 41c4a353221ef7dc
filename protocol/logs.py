"""How a noria process writes its log records to stderr: one setup for every process of a command.

Two styles, chosen by the command the user ran and handed on to the engine processes it
starts (`child_args`), so that one command speaks with one voice:

* SERVICE (`noria serve`, `noria worker`, the engine processes under them, and one-shot
  commands given -v): records with time, logger and level, for an operator reading a log.
* BRIEF (one-shot commands such as `noria generate`, without -v): warnings only, each as
  "noria: warning: MESSAGE", no time stamps, no tracebacks. An error is logged once, by the
  process that meets it, and passed on from there; in a one-shot command it ends in the
  command's final "noria: error: ..." line, so error records are left out here rather
  than said twice.
"""

from __future__ import annotations

import logging
import sys

SERVICE = "service"
BRIEF = "brief"
STYLES = (SERVICE, BRIEF)
STYLE_FLAG = "--log-style"
_TIMESTAMPED = "%(asctime)s %(name)s %(levelname)s %(message)s"

_style = SERVICE
_handler: logging.Handler | None = None


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return logging.WARNING <= record.levelno < logging.ERROR


class _BriefFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"noria: warning: {record.getMessage()}"  # exc_info and stack left out on purpose


def setup(style: str = SERVICE, level: int = logging.INFO) -> None:
    """Send this process's records to stderr in `style`, SERVICE from `level` up.

    Like logging.basicConfig, it leaves a root logger that someone else has given handlers
    (an application embedding noria, a test's log capture) as it is, and then the engine
    processes started from here keep the SERVICE style too: their records are that
    someone's to filter, not this call's."""
    global _style, _handler
    if style not in STYLES:
        raise ValueError(f"log style must be one of {', '.join(STYLES)}, got {style!r}")
    root = logging.getLogger()
    if _handler is not None and _handler in root.handlers:
        root.removeHandler(_handler)
    elif root.handlers:
        return
    _style = style
    handler = logging.StreamHandler(sys.stderr)
    if style == BRIEF:
        handler.addFilter(_WarningsOnly())
        handler.setFormatter(_BriefFormatter())
        level = logging.WARNING
    else:
        handler.setFormatter(logging.Formatter(_TIMESTAMPED))
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler


def style() -> str:
    return _style


def child_args() -> list[str]:
    """The command-line arguments that give an engine process (`python -m noria.scheduler`,
    `python -m noria.worker`) this process's style."""
    return [STYLE_FLAG, _style]
