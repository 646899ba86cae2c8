"""Model surgery: find every attention in a model and run it on the fused operator.

``replace`` swaps ``nn.MultiheadAttention`` modules and plans the other routes; ``sdpa_route``
reroutes ``F.scaled_dot_product_attention`` calls; ``transformers`` registers with Hugging Face's
attention interface; ``diffusers`` sets attention processors through diffusers' own API; ``patterns``
rewrites hand-written softmax attention in exported graphs, and ``fuse`` runs that rewrite in
PyTorch (``fuse_patterns``, ``torch.compile(backend="attn_export")``); ``plan`` is the export's
plan without exporting; ``site_report`` is the per-site report all of them fill in.
"""
