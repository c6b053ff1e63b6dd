"""Mistakes a framework author makes, for tests/test_plugin.py: each must be refused in one line that names it."""
import dataclasses

from hnclip_jax import frameworks
from patch_align import PatchAlign, PatchAlignTerm


class Misspelled(PatchAlign):
  """`objectives` for `objective`: without the contract check it would train plain L_HN without a word."""
  objectives = PatchAlign.objective
  objective = frameworks.Framework.objective


class WrongArguments(PatchAlign):
  @staticmethod
  def objective(config):
    raise AssertionError("never called: the contract refuses the signature first")


@dataclasses.dataclass(frozen=True)
class TextTerm(PatchAlignTerm):
  """Reads the model outputs under a name they do not have (the caption embeddings are "txt")."""

  def __call__(self, out, ctx, sched):
    return super().__call__({**out, "txt": out["text"]}, ctx, sched)


class AsksForText(PatchAlign):
  @staticmethod
  def objective(config, obj):
    return obj.replace(terms=obj.terms + (TextTerm(weight=float(frameworks.settings(config).weight)),))
