"""Entry-point helper: configuration and input errors end the program with one clear line, not a traceback."""
from __future__ import annotations

import functools
import os
import sys


def clean_errors(main):
  """Wraps an absl main: ValueError/FileNotFoundError -> 'error: ...' on stderr, exit 2 (HNCLIP_TRACEBACK=1 re-raises)."""

  @functools.wraps(main)
  def wrapped(argv):
    try:
      return main(argv)
    except (ValueError, FileNotFoundError) as e:
      if os.environ.get("HNCLIP_TRACEBACK"):
        raise
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)

  return wrapped
