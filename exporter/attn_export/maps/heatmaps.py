"""Attention heatmaps: the weights of every attention site of a model, original beside fused
beside their difference, per layer and head, for one example input.

    >>> maps = attn_export.heatmaps(model, {"src": x, "src_key_padding_mask": pad})
    >>> maps.sites[0].path, maps.sites[0].original.shape     # ("encoder.layers.0.self_attn", (H, Lq, Lk))
    >>> maps.max_abs_diff, maps.omitted
    >>> maps.save("heatmaps.png")                            # png, svg or pdf (matplotlib)

The original model and a copy with its attention replaced (:func:`attn_export.replace_attention`)
run the same inputs under :class:`~attn_export.maps.capture.AttentionCapture`; sites pair up
by module path. Masked pairs (weight exactly 0, or NaN where the stock layer gives NaN) are drawn
grey, so the key-padding and causal patterns show.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from attn_export.errors import InputError
from attn_export.maps.plotting import require_matplotlib

# Panel edge in inches and the resolution: the picture's size in pixels follows from the grid.
PANEL_INCHES = 1.6
DPI = 100
FORMATS = ("png", "svg", "pdf")


@dataclass
class SiteWeights:
    """One attention site: weights ``[H, Lq, Lk]`` of the original and of the fused model."""

    path: str
    original: np.ndarray
    fused: np.ndarray

    @property
    def difference(self) -> np.ndarray:
        """fused - original; NaN where the original is NaN (a query whose keys are all masked:
        the stock layer's NaN, the fused operator's zeros)."""
        return self.fused - self.original

    @property
    def max_abs_diff(self) -> float:
        diff = self.difference
        finite = np.isfinite(diff)
        return float(np.abs(diff[finite]).max()) if finite.any() else 0.0


@dataclass
class Heatmaps:
    sites: List[SiteWeights]
    batch_index: int
    omitted: List[str] = field(default_factory=list)
    max_heads: int = 4

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.sites), default=0.0)

    @property
    def heads_drawn(self) -> int:
        return min(self.max_heads, max((s.original.shape[0] for s in self.sites), default=1))

    @property
    def grid(self):
        """(rows, columns) of panels: one row per site, three panels (original, fused,
        difference) per head drawn."""
        return len(self.sites), 3 * self.heads_drawn

    @property
    def figure_inches(self):
        rows, cols = self.grid
        return cols * PANEL_INCHES + _LEFT + _RIGHT, rows * PANEL_INCHES + _TOP + _BOTTOM

    @property
    def pixel_size(self):
        """(width, height) of the PNG that :meth:`save` writes."""
        width, height = self.figure_inches
        return round(width * DPI), round(height * DPI)

    def save(self, path, fmt: Optional[str] = None) -> None:
        """Writes the picture (whole or not at all); ``fmt`` defaults to the path's suffix."""
        from attn_export.atomic_io import atomic_output

        fmt = fmt or (str(path).rpartition(".")[2].lower() if "." in str(path) else "png")
        if fmt not in FORMATS:
            raise InputError(f"unknown picture format {fmt!r}: use one of {', '.join(FORMATS)}")
        fig = self.figure()
        try:
            with atomic_output(path) as tmp:
                fig.savefig(tmp, format=fmt, dpi=DPI)
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def figure(self):
        """The matplotlib figure (see :meth:`save`). Laid out by hand, not by matplotlib's
        layout engines: those measure every tick label of every panel and take seconds."""
        plt = require_matplotlib("attention heatmaps")
        rows, cols = self.grid
        width, height = self.figure_inches
        fig = plt.figure(figsize=(width, height))
        weights_map = _masked_colormap(plt, "viridis")
        diff_map = _masked_colormap(plt, "RdBu_r")
        vmax = max((float(np.nanmax(s.original)) for s in self.sites), default=1.0) or 1.0
        dmax = max(self.max_abs_diff, 1e-12)
        images = {}
        for row, site in enumerate(self.sites):
            masked = ~np.isfinite(site.original) | (site.original == 0)
            y = height - _TOP - (row + 1) * PANEL_INCHES
            fig.text(0.1 / width, (y + PANEL_INCHES / 2) / height, _short(site.path), rotation=90, fontsize=5,
                     va="center", ha="left")
            for head in range(min(self.heads_drawn, site.original.shape[0])):
                for part, (what, values) in enumerate(zip(
                        ("original", "fused", "fused - original"),
                        (site.original[head], site.fused[head], site.difference[head]))):
                    col = 3 * head + part
                    ax = fig.add_axes(((_LEFT + col * PANEL_INCHES + _GAP) / width, (y + _GAP) / height,
                                       (PANEL_INCHES - 2 * _GAP) / width, (PANEL_INCHES - 2 * _GAP) / height))
                    shown = np.ma.masked_array(values, mask=masked[head])
                    diff = part == 2
                    images[diff] = ax.imshow(shown, cmap=diff_map if diff else weights_map,
                                             vmin=-dmax if diff else 0.0, vmax=dmax if diff else vmax,
                                             interpolation="nearest", aspect="auto")
                    ax.set_title(f"h{head} {what}", fontsize=6, pad=2)
                    _token_axes(ax, *values.shape, first_column=col == 0, bottom_row=row == rows - 1)
        for i, (diff, label) in enumerate(((False, "attention weight (grey: masked)"), (True, "fused - original"))):
            cax = fig.add_axes(((width - _RIGHT + 0.15 + 0.5 * i) / width, _BOTTOM / height,
                                0.1 / width, (height - _TOP - _BOTTOM) / height))
            bar = fig.colorbar(images[diff], cax=cax)
            bar.set_label(label, fontsize=6)
            bar.ax.tick_params(labelsize=5)
        fig.suptitle(f"attention weights, batch element {self.batch_index}: original | fused | difference per "
                     f"head; max |fused - original| = {self.max_abs_diff:.2e}", fontsize=8,
                     y=1 - 0.12 / height, va="top")
        if self.omitted:
            fig.text(0.1 / width, 0.04 / height, "not drawn: " + "; ".join(self.omitted)[:400], fontsize=5,
                     va="bottom")
        return fig


# Margins in inches around the panels: site names on the left, the two colour bars on the
# right, the title above, the axis labels and notes below.
_LEFT, _RIGHT, _TOP, _BOTTOM, _GAP = 0.5, 1.3, 0.7, 0.5, 0.17


def _masked_colormap(plt, name: str):
    cmap = plt.get_cmap(name).copy()
    cmap.set_bad("#c8c8c8")
    return cmap


def _short(path: str, line: int = 26) -> str:
    """The site's path on at most two lines of ``line`` characters (broken at a dot; the
    start elided when even that is too long): the row label beside the panels."""
    if len(path) <= line:
        return path
    if len(path) > 2 * line:
        path = "..." + path[-(2 * line - 3):]
    dots = [i for i, c in enumerate(path) if c == "."] or [len(path) // 2]
    cut = min(dots, key=lambda i: abs(i - len(path) / 2)) + 1
    return path[:cut] + "\n" + path[cut:]


def _token_axes(ax, lq: int, lk: int, *, first_column: bool, bottom_row: bool) -> None:
    """Token positions on the axes, labelled on the outer panels only (few labels: text is
    what makes a picture slow to draw)."""
    ax.set_xticks(range(0, lk, max(1, -(-lk // 4))))
    ax.set_yticks(range(0, lq, max(1, -(-lq // 4))))
    ax.tick_params(labelsize=5, length=2, pad=1, labelbottom=bottom_row, labelleft=first_column)
    if bottom_row:
        ax.set_xlabel("key token", fontsize=5, labelpad=1)
    if first_column:
        ax.set_ylabel("query token", fontsize=5, labelpad=1)


def capture_weights(model: nn.Module, inputs: Mapping[str, torch.Tensor], batch_index: int = 0):
    """{site path: Tensor[H, Lq, Lk]} of one forward call of ``model`` (not modified)."""
    from attn_export.maps.capture import AttentionCapture

    with torch.no_grad(), AttentionCapture(model, batch_index=batch_index) as capture:
        model(**inputs)
    return capture.weights


def heatmaps(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    *,
    layer: Optional[str] = None,
    batch_index: int = 0,
    max_layers: int = 6,
    max_heads: int = 4,
) -> Heatmaps:
    """The attention weights of ``model`` (not modified) and of a copy with its attention
    fused, for ``inputs`` (name -> tensor, as for export).

    Args:
        layer: draw only the site at this module path (or those under it).
        batch_index: the batch element drawn.
        max_layers, max_heads: caps on what :meth:`Heatmaps.save` draws; ``omitted`` says what
            was left out.
    """
    from attn_export.surgery.replace import replace_attention

    if max_layers < 1 or max_heads < 1:
        raise InputError("the caps on layers and heads drawn must be >= 1")
    original = copy.deepcopy(model).eval()
    fused = copy.deepcopy(model).eval()
    replace_attention(fused)
    before = capture_weights(original, inputs, batch_index)
    after = capture_weights(fused, inputs, batch_index)
    paths = [p for p in before if p in after]
    omitted = []
    one_sided = [f"{p} (original only)" for p in before if p not in after] + \
                [f"{p} (fused only)" for p in after if p not in before]
    if one_sided:
        omitted.append("captured on one side only: " + ", ".join(one_sided))
    if layer is not None:
        chosen = [p for p in paths if p == layer or p.startswith(layer + ".") or p.startswith(layer + "#")]
        if not chosen:
            raise InputError(f"--layer {layer}: no attention site there; sites: {', '.join(paths) or 'none'}")
        paths = chosen
    if not paths:
        raise InputError("no attention weights were captured: the model ran no nn.MultiheadAttention, "
                         "scaled_dot_product_attention or fused attention call")
    if len(paths) > max_layers:
        omitted.append(f"{len(paths) - max_layers} of {len(paths)} sites (max {max_layers} layers): "
                       + ", ".join(paths[max_layers:]))
        paths = paths[:max_layers]
    sites = [SiteWeights(p, before[p].numpy(), after[p].numpy()) for p in paths]
    heads = max(s.original.shape[0] for s in sites)
    if heads > max_heads:
        omitted.append(f"heads {max_heads}-{heads - 1} of each layer (max {max_heads} heads)")
    return Heatmaps(sites, batch_index=batch_index, omitted=omitted, max_heads=max_heads)
