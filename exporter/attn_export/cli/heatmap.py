"""``attn-export heatmap``: the attention weights of the original and the fused model, drawn."""
from __future__ import annotations

import click

from attn_export.cli._common import common_verb
from attn_export.cli._options import input_options, logging_options, model_options

FORMATS = ("png", "svg", "pdf")


@click.command("heatmap")
@click.argument("model_path", metavar="[MODEL]", required=False, type=click.Path())
@model_options
@input_options
@click.option("-o", "--output", "output", metavar="PATH", type=click.Path(dir_okay=False), default="heatmaps.png",
              show_default=True, help="Where to write the picture.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Picture format (default: the output's suffix, else png).")
@click.option("--layer", "layer", metavar="PATH",
              help="Draw only the attention site at this module path (as `attn-export inspect` lists them), "
                   "or the sites under it.")
@click.option("--batch-index", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which element of the example batch to draw.")
@click.option("--max-layers", type=click.IntRange(min=1), default=6, show_default=True,
              help="Draw at most this many attention sites (the picture says which were left out).")
@click.option("--max-heads", type=click.IntRange(min=1), default=4, show_default=True,
              help="Draw at most this many heads per site (the picture says which were left out).")
@logging_options
@common_verb
def heatmap(session, model_path, model_args, input_args, output, fmt, layer, batch_index, max_layers, max_heads):
    """Draw the attention weights of every attention site of MODEL for one example input:
    per site (row) and head, the original model, the fused model and their difference, with
    masked pairs in grey, token positions on the axes and colour bars. The weights are the
    ones the models compute: nn.MultiheadAttention and the fused layer return them
    (need_weights); scaled_dot_product_attention calls and fused operator calls (transformers
    layers, the SDPA route) are taken from each call's own query, key and masks.

    MODEL and the input options are as for `attn-export convert`. Needs matplotlib
    (pip install 'attn-export[plot]').

    \b
    Examples:
      attn-export heatmap model.pt -o heatmaps.png
      attn-export heatmap model.pt --layer transformer.encoder.layers.0.self_attn --batch-index 1 -o enc0.svg
      attn-export heatmap ./bert-tiny --input input_ids:1x12:int64 --max-heads 2 -o bert.pdf
    """
    import torch

    from attn_export.maps.plotting import require_matplotlib
    from attn_export.maps.heatmaps import heatmaps

    require_matplotlib("attn-export heatmap")  # before the model loads: says what to install
    with session.step("loading the model"):
        model, source = model_args.load(model_path, seed=input_args.seed)
        torch.manual_seed(input_args.seed)
        inputs = input_args.example_inputs(model)
    with session.step("running the original and the fused model"):
        maps = heatmaps(model, inputs, layer=layer, batch_index=batch_index, max_layers=max_layers,
                        max_heads=max_heads)
    with session.step(f"drawing {output}"):
        maps.save(output, fmt=fmt)
    for note in maps.omitted:
        session.note(f"note: not drawn: {note}")
    width, height = maps.pixel_size
    session.out.print(f"wrote {output}: {len(maps.sites)} attention site(s) of {source}, "
                      f"{maps.heads_drawn} head(s) each ({width}x{height} px as PNG), "
                      f"max |fused - original| = {maps.max_abs_diff:.2e}")
