"""What one pooling request asks for (an engine started with --runner pooling runs nothing else).

A pooling request runs its prompt through the model and gets back one vector instead of tokens:
- "embed": the engine's pooler over the final hidden states (pagedllm.worker.pooler: the last
  token's, their mean, or the first token's), cut to its first `dimensions` values (Matryoshka
  embeddings are trained so that a prefix is an embedding too), then scaled to unit length if
  `normalize`;
- "score": at the last token, the probabilities of the label tokens (softmax over their logits
  alone), as a causal reranker reads its verdict (Qwen3-Reranker: P("yes") against "no";
  pagedllm.text.score_prompt); or, with no label tokens, of a *ForSequenceClassification
  checkpoint's labels (its score head; one label: the sigmoid of its logit);
- "reward": a *ForSequenceClassification checkpoint's raw label logits at the last token (a reward
  model's one logit is its reward).
Checked here, so that a value the core cannot run never reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "score", "reward")


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # embed: keep the first this many values (None: all)
    normalize: bool = True  # embed: scale to unit length (after cutting to dimensions)
    label_token_ids: tuple[int, ...] = ()  # score: the label tokens, the positive one last

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")
        if self.task == "score" and len(self.label_token_ids) == 1:
            raise ValueError("a score request needs two label_token_ids or more (the positive one "
                             f"last), or none (a classifier's head); got {self.label_token_ids!r}")
        if self.task != "score" and self.label_token_ids:
            raise ValueError(f"label_token_ids belong to score requests, not {self.task} ones")

    def check_fits(self, hidden_size: int, vocab_size: int) -> None:
        """ValueError naming the field that the model cannot serve."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size, {hidden_size}; "
                             f"got {self.dimensions}")
        bad = [t for t in self.label_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"label_token_ids must be token ids below {vocab_size}; got {bad}")


@dataclass(frozen=True)
class PoolingSetup:
    """What a pooling engine serves, as the input processor needs it to check and fill requests
    (from EngineConfig and the model's config)."""

    hidden_size: int
    normalize: bool  # EngineConfig.pooling_normalize: for requests that do not say
    score_tokens: tuple[str, ...]  # EngineConfig.score_tokens: the labels, the positive last
    # A *ForSequenceClassification checkpoint's labels: its score head, not label tokens, makes a
    # score (0: a causal LM).
    num_labels: int = 0
    # An embedder's engine (--task embed): a score is the cosine similarity of the two texts'
    # embeddings (pagedllm.pooling_score), not a reranker's verdict.
    scores_by_similarity: bool = False

    @classmethod
    def of(cls, config, hidden_size: int, num_labels: int = 0) -> PoolingSetup | None:
        """The setup of an EngineConfig's engine over a model (None: a generation engine)."""
        if config.runner != "pooling":
            return None
        return cls(hidden_size, config.pooling_normalize, tuple(config.score_tokens), num_labels,
                   scores_by_similarity=config.task == "embed" and not num_labels)
