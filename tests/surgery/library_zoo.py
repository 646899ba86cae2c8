"""Models from libraries nobody on this project wrote, built from small configs with random weights
(nothing downloaded), with example inputs: the library zoo's cases. Each builder imports its
library and raises ImportError (the test skips with the reason) when it is not installed.

``expected``: attention sites the export fuses (one FusedAttention node per call); sites the
operator cannot express by design are listed in ``unfused`` with the reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from _timm import torchvision_placeholders


@dataclass
class ZooCase:
    library: str
    build: Callable[[], tuple]  # () -> (model, inputs)
    nodes: int  # FusedAttention nodes in the export
    unfused: List[str] = field(default_factory=list)  # site paths left unfused on purpose
    dynamic: Dict[str, Dict[int, str]] = None  # None: the exporter's defaults


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        model, inputs = fn()
        return model.eval(), inputs
    return build


@_seeded
def unet():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)
    return model, {"sample": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(2, 5, 16)}


@_seeded
def sd3():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    return model, {"hidden_states": torch.randn(2, 4, 8, 8), "encoder_hidden_states": torch.randn(2, 5, 16),
                   "pooled_projections": torch.randn(2, 16), "timestep": torch.tensor([3, 7])}


@_seeded
def flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    length, text = 6, 4
    return model, {"hidden_states": torch.randn(2, length, 4), "encoder_hidden_states": torch.randn(2, text, 16),
                   "pooled_projections": torch.randn(2, 16), "timestep": torch.tensor([0.3, 0.7]),
                   "img_ids": torch.randn(length, 3), "txt_ids": torch.randn(text, 3)}


@_seeded
def llama3():
    from torchtune.models.llama3 import llama3 as build

    model = build(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64)
    return model, {"tokens": torch.randint(0, 64, (2, 9))}


@_seeded
def x_vit():
    from x_transformers import Encoder, ViTransformerWrapper

    model = ViTransformerWrapper(image_size=16, patch_size=4, num_classes=5,
                                 attn_layers=Encoder(dim=32, depth=2, heads=4))
    return model, {"img": torch.randn(2, 3, 16, 16)}


class _Whisper(torch.nn.Module):
    """Whisper with its SDPA switch set while it runs: whisper reads the class attribute
    ``MultiHeadAttention.use_sdpa`` at call time, and a test must not leave it changed."""

    def __init__(self, model, use_sdpa: bool):
        super().__init__()
        self.model, self.use_sdpa = model, use_sdpa

    def forward(self, mel, tokens):
        import whisper.model as wm

        previous, wm.MultiHeadAttention.use_sdpa = wm.MultiHeadAttention.use_sdpa, self.use_sdpa
        try:
            return self.model(mel, tokens)
        finally:
            wm.MultiHeadAttention.use_sdpa = previous


def _whisper(use_sdpa: bool):
    import whisper.model as wm

    dims = wm.ModelDimensions(n_mels=8, n_audio_ctx=8, n_audio_state=16, n_audio_head=2, n_audio_layer=1,
                              n_vocab=40, n_text_ctx=8, n_text_state=16, n_text_head=2, n_text_layer=1)
    torch.manual_seed(0)
    whisper = wm.Whisper(dims)
    # whisper leaves the decoder's positional embedding uninitialized (torch.empty: NaN at times)
    torch.nn.init.normal_(whisper.decoder.positional_embedding, std=0.02)
    model = _Whisper(whisper, use_sdpa).eval()
    return model, {"mel": torch.randn(2, 8, 16), "tokens": torch.randint(0, 40, (2, 5))}


def whisper_manual():
    return _whisper(False)


def whisper_sdpa():
    return _whisper(True)


@_seeded
def sam_encoder():
    with torchvision_placeholders():
        from segment_anything.modeling import ImageEncoderViT

    model = ImageEncoderViT(img_size=32, patch_size=8, in_chans=3, embed_dim=32, depth=2, num_heads=2,
                            out_chans=16, use_rel_pos=True, window_size=2, global_attn_indexes=(1,))
    return model, {"x": torch.randn(1, 3, 32, 32)}


@_seeded
def vit_pytorch():
    with torchvision_placeholders():
        from vit_pytorch import ViT

    model = ViT(image_size=16, patch_size=4, num_classes=5, dim=32, depth=2, heads=4, mlp_dim=64, dim_head=8)
    return model, {"img": torch.randn(2, 3, 16, 16)}


@_seeded
def timm_swin():
    with torchvision_placeholders():
        import timm
        import timm.models.swin_transformer  # noqa: F401

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
                              depths=(1, 1), num_heads=(2, 4), window_size=7, num_classes=5)
    return model, {"x": torch.randn(2, 3, 56, 56)}


@_seeded
def sentence_bert():
    import tempfile

    import transformers
    from sentence_transformers import SentenceTransformer, models

    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    folder = tempfile.mkdtemp(prefix="sbert-")
    transformers.BertModel(config).save_pretrained(folder)
    transformers.BertTokenizerFast(vocab_file=_vocab(folder)).save_pretrained(folder)
    encoder = models.Transformer(folder)
    model = SentenceTransformer(modules=[encoder, models.Pooling(32)])
    ids = torch.randint(1, 97, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return _SentenceEmbedding(model), {"input_ids": ids, "attention_mask": mask}


def _vocab(folder: str) -> str:
    import os

    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(92)]) + "\n")
    return path


class _SentenceEmbedding(torch.nn.Module):
    """sentence-transformers takes a feature dict: named tensor inputs in, the embedding out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model({"input_ids": input_ids, "attention_mask": attention_mask})["sentence_embedding"]


CASES = {
    "diffusers-unet": ZooCase("diffusers", unet, nodes=8),
    "diffusers-sd3": ZooCase("diffusers", sd3, nodes=1),
    "diffusers-flux": ZooCase("diffusers", flux, nodes=2),
    "torchtune-llama3": ZooCase("torchtune", llama3, nodes=2),
    "x-transformers-vit": ZooCase("x_transformers", x_vit, nodes=2),
    "whisper-manual": ZooCase("whisper", whisper_manual, nodes=3),
    # is_causal=q.shape[2] > 1 on a dynamic token length is a SymBool torch.export refuses: batch only
    "whisper-sdpa": ZooCase("whisper", whisper_sdpa, nodes=3, dynamic={"mel": {0: "batch"}, "tokens": {0: "batch"}}),
    "sam-encoder": ZooCase("segment_anything", sam_encoder, nodes=2),
    "vit-pytorch": ZooCase("vit_pytorch", vit_pytorch, nodes=2),
    "timm-swin": ZooCase("timm", timm_swin, nodes=2),
    "sentence-transformers": ZooCase("sentence_transformers", sentence_bert, nodes=2),
}
