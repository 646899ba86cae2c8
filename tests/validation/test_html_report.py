"""The HTML parity report: one self-contained page (parses, images embedded as data: URIs,
nothing from the network) that puts the verdict first, marks the failing cases of a tampered
export as failing and shows where it failed; and it renders in a headless browser."""
import base64
import html.parser
import shutil
import subprocess
import sys

import pytest
import torch

from attn_export.validation import validate
from attn_export.validation.error_profile import error_profile
from helpers import invoke, one_line_error
from test_validation import corrupt

pytest.importorskip("matplotlib", reason="the HTML report needs matplotlib (pip install 'attn-export[plot]')")

SEQ2SEQ_LAYERS = ["transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                  "transformer.decoder.layers.0.multihead_attn"]


class Page(html.parser.HTMLParser):
    """What a reader sees: the verdict, table rows (class and cells), images, external links."""

    def __init__(self, text):
        super().__init__()
        self.rows, self.images, self.external, self.tags = [], [], [], set()
        self.verdict, self._in_verdict, self._row, self._cell = "", False, None, None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        for name in ("src", "href"):
            if attrs.get(name, "").startswith(("http:", "https:", "//")):
                self.external.append(attrs[name])
        if tag == "img":
            self.images.append(attrs["src"])
        if attrs.get("id") == "verdict":
            self._in_verdict = True
        if tag == "tr":
            self._row = (attrs.get("class", ""), [])
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "div":
            self._in_verdict = False
        if tag == "td" and self._row is not None:
            self._row[1].append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._in_verdict:
            self.verdict += data
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def tampered_run(small_seq2seq, exported_seq2seq, tmp_path_factory):
    """`attn-export validate MODEL tampered.onnx --html report.html`: (exit code, page text)."""
    folder = tmp_path_factory.mktemp("html")
    model_file, bad = folder / "model.pt", folder / "tampered.onnx"
    torch.save(small_seq2seq, model_file)
    corrupt(exported_seq2seq.path, bad, "perturb")
    proc = invoke("validate", model_file, bad, "--allow-class", "attn_export.examples:TinySeq2Seq",
                  "--html", folder / "report.html")
    return proc, (folder / "report.html").read_text()


def test_tampered_export_page_shows_the_failure(tampered_run):
    proc, text = tampered_run
    assert proc.returncode == 1, proc.stderr
    page = Page(text)
    assert page.verdict.startswith("FAILED"), page.verdict
    assert text.index('id="verdict"') < text.index("<h2>")  # the verdict comes first
    cases = [(cls, cells) for cls, cells in page.rows if len(cells) == 10]
    ort = [(cls, cells) for cls, cells in cases if cells[2] == "onnxruntime"]
    replaced = [(cls, cells) for cls, cells in cases if cells[2] == "pytorch-replaced"]
    assert ort and all(cls == "failed" and cells[8] == "FAILED" for cls, cells in ort)
    assert replaced and all(cls == "passed" and cells[8] == "PASSED" for cls, cells in replaced)
    assert "Worst elements of the failing cases" in text
    # the worst elements of the failing cases exceed the tolerance (last column > 1)
    worst = [cells for cls, cells in page.rows if len(cells) == 6 and cells[1] == "onnxruntime"]
    assert worst and max(float(cells[5]) for cells in worst) > 1.0
    coverage = {cells[0]: cells[3] for cls, cells in page.rows if len(cells) == 5}
    assert coverage == dict.fromkeys(SEQ2SEQ_LAYERS, "replaced")
    assert any(cells[0] == "onnxruntime" for cls, cells in page.rows if len(cells) == 2)  # environment


def test_page_is_self_contained(tampered_run):
    page = Page(tampered_run[1])
    assert not page.external and not page.tags & {"script", "link", "iframe"}
    assert len(page.images) == 1  # one plot per output (the model has one)
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.partition(",")[2])[:8] == b"\x89PNG\r\n\x1a\n"


def test_honest_export_page_passes(small_seq2seq, exported_seq2seq):
    report = validate(small_seq2seq, exported_seq2seq.path, small_seq2seq.example_inputs)
    page = Page(report.to_html())
    assert report.passed and page.verdict.startswith("PASSED")
    assert not [cls for cls, cells in page.rows if cls in ("failed", "error")]


def test_error_profile_bins_and_worst_elements():
    expected = torch.tensor([[0.0, 1.0], [2.0, float("nan")]], dtype=torch.float64)
    actual = torch.tensor([[0.0, 1.0 + 2e-3], [2.0 + 5e-6, 7.0]], dtype=torch.float64)
    profile = error_profile(actual, expected, atol=1e-3)
    # [0, 0] exact -> the first bin; [1, 0] 5e-3 x atol -> [1e-3, 1e-2); [0, 1] 2 x atol -> [1, 10)
    edges, counts = profile["log10_edges"], profile["counts"]
    assert profile["elements"] == 3 and sum(counts) == 3
    assert counts[0] == 1 and counts[edges.index(-3.0)] == 1 and counts[edges.index(0.0)] == 1
    assert profile["worst"][0]["index"] == [0, 1] and profile["worst"][0]["ratio"] == pytest.approx(2.0)
    assert [w["index"] for w in profile["worst"]] == [[0, 1], [1, 0], [0, 0]]  # the NaN reference is left out


def test_html_option_errors(tmp_path, monkeypatch):
    one_line_error(invoke("convert", "--model", "attn_export.examples:tiny_seq2seq", "--no-validate", "--html",
                          tmp_path / "r.html", "-o", tmp_path / "m.onnx"), "--html", "--no-validate")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    one_line_error(invoke("validate", "--model", "attn_export.examples:tiny_seq2seq", tmp_path / "m.onnx",
                          "--html", tmp_path / "r.html"), "pip install 'attn-export[plot]'")
    assert not list(tmp_path.iterdir())


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_page_renders_in_a_headless_browser(tampered_run, tmp_path):
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless browser installed (apt-get install chromium)")
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    page.write_text(tampered_run[1])
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a page, not a blank
