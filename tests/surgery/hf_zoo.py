"""The Hugging Face model zoo of tests/surgery/test_hf_zoo.py: small random-weight configs of the
architectures that dispatch through transformers' AttentionInterface (nothing downloaded), and
example inputs for each.

Every config is as small as the architecture allows (2 layers, width 32, 4 heads) and keeps the
features that change the attention call: grouped-query heads (Llama, Mistral, Qwen, Gemma),
a sliding window shorter than the test sequence (Mistral, Gemma 2, Gemma 3), logit
soft-capping (Gemma 2), T5's relative position bias, causal and bidirectional masks,
encoder-decoder cross-attention, vision and text towers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

SEQ = 12      # the example sequence: longer than every configured sliding window
WINDOW = 4    # sliding windows (Mistral, Gemma 2/3): shorter than SEQ, so they matter
VOCAB = 99
IMAGE = 16

_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               image_size=IMAGE, patch_size=4)


@dataclass
class Arch:
    """One architecture: its model_type, config overrides, what it is, and its inputs kind."""

    name: str
    model_type: str
    config: Dict
    family: str                      # encoder | decoder | encoder-decoder | vision | multimodal
    inputs: str = "text"             # text | seq2seq | pixels | text+pixels | audio
    features: str = ""               # what the config exercises, for the docs table
    extra: Dict = field(default_factory=dict)


ZOO = [
    Arch("BERT", "bert", _BERT_LIKE, "encoder"),
    Arch("RoBERTa", "roberta", dict(_BERT_LIKE, pad_token_id=1), "encoder"),
    Arch("DistilBERT", "distilbert", dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                          max_position_embeddings=64), "encoder"),
    Arch("ALBERT", "albert", dict(_BERT_LIKE, embedding_size=16), "encoder"),
    Arch("ELECTRA", "electra", dict(_BERT_LIKE, embedding_size=16), "encoder"),
    Arch("XLM-RoBERTa", "xlm-roberta", dict(_BERT_LIKE, pad_token_id=1), "encoder"),
    Arch("GPT-2", "gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64), "decoder"),
    Arch("GPT-NeoX", "gpt_neox", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64), "decoder",
         features="partial rotary"),
    Arch("OPT", "opt", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64), "decoder"),
    Arch("Llama", "llama", _DECODER, "decoder", features="grouped-query heads"),
    Arch("Mistral", "mistral", dict(_DECODER, sliding_window=WINDOW), "decoder",
         features=f"grouped-query heads, sliding window {WINDOW}"),
    Arch("Mixtral", "mixtral", dict(_DECODER, num_local_experts=2, num_experts_per_tok=1), "decoder",
         features="grouped-query heads, mixture of experts"),
    Arch("Qwen2", "qwen2", _DECODER, "decoder", features="grouped-query heads"),
    Arch("Qwen3", "qwen3", dict(_DECODER, head_dim=8), "decoder", features="grouped-query heads, q/k norm"),
    Arch("Phi-3", "phi3", dict(_DECODER, pad_token_id=0), "decoder", features="grouped-query heads"),
    Arch("Gemma", "gemma", dict(_DECODER, head_dim=8), "decoder", features="grouped-query heads"),
    Arch("Gemma 2", "gemma2", dict(_DECODER, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=None), "decoder",
         features=f"logit soft-capping 5.0, sliding window {WINDOW} (alternate layers)"),
    Arch("Gemma 3 (text)", "gemma3_text", dict(_DECODER, head_dim=8, sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention"]), "decoder",
         features=f"sliding window {WINDOW} (layer 0), q/k norm"),
    Arch("Falcon", "falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
         "decoder", features="multi-query heads"),
    Arch("GPT-OSS", "gpt_oss", dict(_DECODER, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                                    sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
         "decoder", features="attention sinks (left on transformers' attention), mixture of experts"),
    Arch("T5", "t5", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, decoder_start_token_id=0), "encoder-decoder",
         inputs="seq2seq", features="relative position bias"),
    Arch("BART", "bart", _SEQ2SEQ, "encoder-decoder", inputs="seq2seq"),
    Arch("mBART", "mbart", _SEQ2SEQ, "encoder-decoder", inputs="seq2seq"),
    Arch("Pegasus", "pegasus", _SEQ2SEQ, "encoder-decoder", inputs="seq2seq"),
    Arch("Whisper", "whisper", dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                    max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    decoder_start_token_id=1), "encoder-decoder",
         inputs="audio"),
    Arch("ViT", "vit", _VISION, "vision", inputs="pixels"),
    Arch("DeiT", "deit", _VISION, "vision", inputs="pixels"),
    Arch("CLIP", "clip", dict(text_config=dict(_BERT_LIKE), vision_config=dict(_VISION), projection_dim=16),
         "multimodal", inputs="text+pixels"),
    Arch("SigLIP", "siglip", dict(text_config=dict(_BERT_LIKE), vision_config=dict(_VISION)),
         "multimodal", inputs="text+pixels", features="text tower without padding mask"),
]

BY_NAME = {a.name: a for a in ZOO}


def build(arch: Arch, seed: int = 0):
    """The architecture's base model (``AutoModel``) with random weights, eval mode, float32."""
    import transformers

    config = transformers.AutoConfig.for_model(arch.model_type, **arch.config)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config)
    return model.eval()


def padded_tokens(batch: int, seq: int, lengths, seed: int = 0, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def example_inputs(arch: Arch, model, batch: int = 2, seq: int = SEQ, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Inputs for ``model``: a right-padded batch of tokens (the second row shorter), images, or
    log-mel features, as the architecture takes them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [seq] + [max(1, seq - 5)] * (batch - 1)
    if arch.inputs == "pixels":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}
    if arch.inputs == "audio":
        config = model.config
        frames = 2 * config.max_source_positions
        ids, _ = padded_tokens(batch, seq // 2, lengths, seed)
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen),
                "decoder_input_ids": ids}
    ids, mask = padded_tokens(batch, seq, lengths, seed)
    if arch.inputs == "seq2seq":
        dec, dec_mask = padded_tokens(batch, seq // 2, [seq // 2] * batch, seed + 1)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    if arch.inputs == "text+pixels":
        out = {"input_ids": ids, "pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}
        if arch.model_type != "siglip":  # SigLIP's text tower takes no attention mask (it pads to a fixed length)
            out["attention_mask"] = mask
        return out
    return {"input_ids": ids, "attention_mask": mask}


def main_outputs(out) -> Dict[str, torch.Tensor]:
    """The float tensors of a ModelOutput worth comparing (hidden states, embeddings)."""
    found = {}
    for name in ("last_hidden_state", "encoder_last_hidden_state", "text_embeds", "image_embeds", "logits",
                 "logits_per_image"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found[name] = value
    return found


def valid_rows(arch: Arch, inputs: Dict[str, torch.Tensor], name: str, value: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, L] booleans of the positions of ``value`` that are real tokens (None: all of them)."""
    mask = inputs.get("attention_mask")
    if mask is None or value.dim() < 3:
        return None
    is_encoder_side = name in ("last_hidden_state",) and arch.inputs != "seq2seq" or name == "encoder_last_hidden_state"
    if is_encoder_side and value.shape[1] == mask.shape[1]:
        return mask.bool()
    return None

