"""hnclip-jax: HN-CLIP (text-similarity margins for dense-caption retrieval) in JAX/Flax."""
import functools
import os
import subprocess

__version__ = "0.1.0"


@functools.cache
def code_version() -> str:
  """Package version plus the git commit of the checkout, when there is one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=5).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ""
  return f"{__version__}+{commit}" if commit else __version__
