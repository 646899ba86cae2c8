"""Attention maps: capture the weights of every site (``capture``), compute the heat maps
(``heatmaps``) and draw them (``plotting``, needs matplotlib)."""
