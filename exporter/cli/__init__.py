"""The ``attn-export`` command line. One module per verb; each verb imports its heavy
dependencies inside the command so that ``attn-export --help`` stays fast."""
import click

from attn_export.cli.bench import bench


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attn-export")
def main() -> None:
    """attn-export: fused multi-head attention for PyTorch models."""


main.add_command(bench)
