"""Model builders: randomly initialised BERT (masked LM) and ViT (classifier) by named size."""

from sparsetrain.models.builders import MODEL_SIZES, build_config, build_model

__all__ = ["MODEL_SIZES", "build_config", "build_model"]
