from attn_export.cli import main

main(prog_name="attn-export")
