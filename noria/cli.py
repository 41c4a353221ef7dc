"""Console-script entry point for `noria`."""

from noria.frontend.cli import main

__all__ = ["main"]
