"""matplotlib for the pictures (heatmaps, the HTML report): an optional dependency, drawn with
the Agg backend (no display needed)."""
from __future__ import annotations

import base64
import io

from attn_export.errors import AttnExportError

INSTALL = "pip install 'attn-export[plot]'"


class MissingPlotting(AttnExportError):
    """matplotlib is not installed (exit 2); the message says what to install."""


def require_matplotlib(what: str):
    """matplotlib.pyplot on the Agg backend; MissingPlotting naming ``what`` when absent."""
    try:
        import matplotlib
    except ImportError:
        raise MissingPlotting(f"{what} needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_data_uri(fig, dpi: int = 100) -> str:
    """The figure as a ``data:image/png;base64,...`` URI (closed afterwards)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
