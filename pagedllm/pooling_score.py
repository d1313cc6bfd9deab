"""A score between two texts from an embedder (an engine started with --task embed): the cosine
similarity of their embeddings (unit length, so their dot product), each text embedded once
however many pairs name it. The instruction, an embedder's query prefix, goes before the first text
of each pair only (the query; documents are embedded as they are)."""

from __future__ import annotations


def texts_to_embed(pairs: list[tuple[str, str]], instruction: str | None) -> list[str]:
    """Every text the pairs need embedded, once each."""
    prefix = instruction or ""
    return list(dict.fromkeys([prefix + q for q, _ in pairs] + [d for _, d in pairs]))


def similarity_scores(pairs: list[tuple[str, str]], instruction: str | None,
                      embeddings: dict[str, list[float]]) -> list[float]:
    """Each pair's cosine similarity, from the unit-length embeddings of texts_to_embed's texts."""
    prefix = instruction or ""
    return [sum(x * y for x, y in zip(embeddings[prefix + q], embeddings[d])) for q, d in pairs]
