"""``--html FILE`` of the verbs that validate (cli/_options.report_options): the report as one
self-contained HTML page."""
from __future__ import annotations


def check_html(html_path) -> None:
    """Before the long work: --html needs matplotlib."""
    if html_path:
        from attn_export.maps.plotting import require_matplotlib

        require_matplotlib("--html")


def write_html(session, report, html_path) -> None:
    from attn_export.errors import InputError
    from attn_export.atomic_io import write_text

    if not html_path:
        return
    try:
        write_text(html_path, report.to_html())
    except OSError as exc:
        raise InputError(f"cannot write the report: {exc.strerror or exc} ({exc.filename})") from exc
    session.note(f"wrote {html_path}")
