"""Model builders: randomly initialised BERT (masked LM, head on the masked positions) and ViT (classifier) by
named size. ``sparsetrain.models.mlm`` holds ``BertForMaskedPositionsLM`` (imported on use: transformers is slow
to import)."""

from sparsetrain.models.builders import MODEL_SIZES, build_config, build_model, takes_masked_positions

__all__ = ["MODEL_SIZES", "build_config", "build_model", "takes_masked_positions"]
