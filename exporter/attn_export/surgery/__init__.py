"""Model surgery: find every attention in a model and run it on the fused operator.

``routes`` is the table of the ways a site is reached, one module each: ``transformers``
(Hugging Face's attention interface, its machinery in ``transformers/``), ``diffusers`` (fused
attention processors), ``sdpa`` (``F.scaled_dot_product_attention`` calls, its machinery in
``sdpa/``), ``module`` (``nn.MultiheadAttention`` swapped); a report row's ``found`` is the name
of the route that reached it. ``replace`` walks a model and applies them (``replace_attention``,
``inspect_attention``, ``restore_attention``); ``patterns`` rewrites hand-written softmax
attention in exported graphs, and ``fuse`` runs that rewrite in PyTorch (``fuse_patterns``,
``torch.compile(backend="attn_export")``); ``plan`` is the export's plan without exporting;
``site_report`` is the per-site report all of them fill in. ``fused_calls(module)`` says what ran
at a site, whichever route reached it. (``sdpa_route`` and ``diffusers`` are the routes' former
homes: deprecated aliases.)
"""
_LAZY = {"fused_calls", "CallCount", "ROUTES"}  # from .routes, imported on first use (it imports the operator)


def __getattr__(name):
    if name in _LAZY:
        from attn_export.surgery import routes

        return getattr(routes, name)
    raise AttributeError(f"module 'attn_export.surgery' has no attribute {name!r}")
