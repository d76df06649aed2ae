"""BERT's masked-LM head on the masked positions only: ``BertForMaskedPositionsLM``.

Only ~15% of the tokens carry a label, but ``BertForMaskedLM`` runs its head (an H x H transform and the
H x V vocabulary decoder) on every token. Given ``masked_positions`` [B, P] (a fixed P per sequence, BERT's
``max_predictions_per_seq``; see :class:`sparsetrain.data.mlm.MLMCollator`) this subclass gathers the
hidden states there and runs the head on B*P rows; the head works on each token alone, so the loss is the
full head's loss. Shapes never depend on the data and nothing reads a value on the host, so the forward
can be captured in a CUDA graph. Parameters and state-dict keys are BertForMaskedLM's (checkpoints are
unchanged), and :func:`to_masked_lm` turns the model back into a plain BertForMaskedLM for exports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertForMaskedLM
from transformers.modeling_outputs import MaskedLMOutput


class BertForMaskedPositionsLM(BertForMaskedLM):
    """``BertForMaskedLM`` whose ``forward`` also takes ``masked_positions`` [B, P] (int64).

    With ``masked_positions`` the logits are [B, P, V], those of the positions listed, and the loss is the
    float32 cross-entropy against ``labels`` [B, S] read at the same positions (-100 ignored, mean over the
    real predictions). Every labelled position must be listed, and a position listed twice must carry the
    label -100 (the collator's padding entries point at position 0, which it never masks): then the loss
    equals ``BertForMaskedLM``'s. Without ``masked_positions`` the model is exactly ``BertForMaskedLM``.

    >>> from transformers import BertConfig
    >>> model = BertForMaskedPositionsLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
    ...                                             num_attention_heads=2, intermediate_size=32))
    >>> ids = torch.randint(5, 50, (2, 8))
    >>> out = model(ids, labels=ids, masked_positions=torch.tensor([[1, 4], [2, 0]]))
    >>> tuple(out.logits.shape)
    (2, 2, 50)
    """

    #: Module-name prefixes that run on the P gathered positions (sparsetrain.flops counts them there).
    masked_positions_modules = ("cls",)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      position_ids=position_ids, inputs_embeds=inputs_embeds)
        if masked_positions is None:
            return super().forward(**inputs, labels=labels, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if attention_mask is None and not kwargs and not self.config.is_decoder:
            hidden, outputs = self._encode_unpadded(input_ids, token_type_ids, position_ids, inputs_embeds), None
        else:
            outputs = self.bert(**inputs, return_dict=True, **kwargs)
            hidden = outputs.last_hidden_state                                   # [B, S, H]
        batch, predictions = masked_positions.shape
        index = masked_positions.unsqueeze(-1).expand(batch, predictions, hidden.shape[-1])
        picked = hidden.gather(1, index)                                         # [B, P, H]
        logits = self.cls(picked.reshape(batch * predictions, -1)).view(batch, predictions, -1)
        loss = None
        if labels is not None:
            targets = labels.gather(1, masked_positions)                         # [B, P]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        out = MaskedLMOutput(loss=loss, logits=logits, hidden_states=getattr(outputs, "hidden_states", None),
                             attentions=getattr(outputs, "attentions", None))
        return out.to_tuple() if return_dict is False else out

    def _encode_unpadded(self, input_ids, token_type_ids, position_ids, inputs_embeds) -> torch.Tensor:
        """The encoder's output [B, S, H] for a batch without padding: embeddings, then the layers with no
        attention mask. ``BertModel`` would build the mask itself, and while a CUDA graph is captured or
        ``torch.compile`` traces, transformers cannot look at the mask's values, so it materialises an all-True
        [B, 1, S, S] mask; scaled-dot-product attention then leaves the flash kernel for the unfused fp32 path
        (measured on an H100: ~45 ms more per BERT-base step at 256x128, in every graph step)."""
        embedded = self.bert.embeddings(input_ids=input_ids, position_ids=position_ids,
                                        token_type_ids=token_type_ids, inputs_embeds=inputs_embeds)
        return self.bert.encoder(embedded, attention_mask=None)[0]


def to_masked_lm(model: nn.Module) -> nn.Module:
    """``model`` as a plain ``BertForMaskedLM`` if it is a :class:`BertForMaskedPositionsLM` (in place: the
    subclass holds no state of its own, only a forward), else unchanged. ``save_pretrained`` then writes
    ``architectures: ["BertForMaskedLM"]``, so ``AutoModelForMaskedLM`` loads the export anywhere."""
    if isinstance(model, BertForMaskedPositionsLM):
        model.__class__ = BertForMaskedLM
    return model


__all__ = ["BertForMaskedPositionsLM", "to_masked_lm"]
