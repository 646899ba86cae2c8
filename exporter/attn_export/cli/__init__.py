"""The ``attn-export`` command line. One module per verb; shared option groups in
``_options.py``; each verb imports its heavy dependencies inside the command so that
``attn-export --help`` stays fast.

``attn-export MODEL --to onnx`` is short for ``attn-export convert MODEL --to onnx``: a first
argument that is not a verb goes to the default verb.
"""
import click

from attn_export.cli.convert import convert
from attn_export.cli.heatmap import heatmap
from attn_export.cli.inspect import inspect_cmd
from attn_export.cli.validate import validate_cmd


class DefaultVerbGroup(click.Group):
    """A group whose unknown first argument (a model path, or an option of the default verb)
    is handed to the default verb, so that ``attn-export model.pt --to onnx`` works as written."""

    default_verb = "convert"
    aliases = {"export": "convert"}
    group_options = ("-h", "--help", "--version")

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in self.aliases and args[0] not in self.group_options:
            args = [self.default_verb, *args]
        return super().parse_args(ctx, args)

    def get_command(self, ctx, name):
        return super().get_command(ctx, self.aliases.get(name, name))


@click.group(cls=DefaultVerbGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attn-export")
def main() -> None:
    """attn-export: fused multi-head attention for PyTorch models, exported to ONNX with a
    portable custom node and to TensorRT with a plugin, and checked in ONNX Runtime and TensorRT.

    \b
    attn-export MODEL --to onnx        replace attention, export, validate
                                       (short for `attn-export convert MODEL --to onnx`)
    attn-export MODEL --to tensorrt    ... and build a TensorRT engine (GPU, TensorRT, plugin)
    attn-export inspect MODEL          list the attention layers and what happens to them
    attn-export validate MODEL ONNX    the parity gate alone (exit 0 pass, 1 mismatch, 2 usage);
                                       --engine FILE adds TensorRT
    attn-export heatmap MODEL          draw the attention weights, original beside fused

    MODEL is a torch.save(model) file or a Hugging Face transformers save_pretrained folder
    (`pip install 'attn-export[hf]'`).

    `attn-export VERB --help` explains each verb.
    """


main.add_command(convert)
main.add_command(inspect_cmd)
main.add_command(validate_cmd)
main.add_command(heatmap)
