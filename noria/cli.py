"""Console-script entry point for `noria`."""

from frontend.cli import main

__all__ = ["main"]
