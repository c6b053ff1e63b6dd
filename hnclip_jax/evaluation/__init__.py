"""Retrieval evaluation: chunked rank counting (Recall@K)."""
from hnclip_jax.evaluation.retrieval import recall_at_k

__all__ = ["recall_at_k"]
