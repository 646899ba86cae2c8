"""The SDPA route's parts, one job each: ``source`` (sites found by reading a forward's source),
``observe`` (sites found by a sample forward), ``translate`` (one SDPA call in the operator's
terms, or why it cannot be), ``intercept`` (the ``TorchFunctionMode`` and the instance forward that
run a module's calls on the operator). :mod:`attn_export.surgery.sdpa_route` is their public face;
:mod:`attn_export.surgery.routes.sdpa` the route that uses them."""
