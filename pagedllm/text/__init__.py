"""Text around the model: tokenizers and vocabularies, chat templates, and the sampling
defaults a model folder ships."""
