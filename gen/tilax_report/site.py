"""What the gen/ scripts call: write the report pages and assets into the mkdocs build."""

from __future__ import annotations

import importlib

import mkdocs_gen_files
import vl_convert
from mkdocs.exceptions import PluginError

from .load import StoredResults, UnreadableResultFile, load_results

# Page module -> generated page, relative to docs/. The nav in mkdocs.yml lists the same paths.
PAGES = {
    "overview": "reports/index.md",
    "moe_layer": "reports/moe-layer.md",
    "moe_internals": "reports/moe-internals.md",
    "moe_decoder": "reports/moe-decoder.md",
    "rbf": "reports/rbf.md",
    "nn_suites": "reports/nn-suites.md",
    "raw_data": "reports/raw-data.md",
}
RAW_DATA_DIR = "reports/data"
VEGA_BUNDLE = "assets/vendor/vega-bundle.js"
VEGA_LITE_VERSION = "6.4"  # matches the Vega-Lite schema Altair 6 writes


def stored_results() -> StoredResults:
    """The loaded results; an unreadable stored file fails the build, naming file and reason."""
    try:
        return load_results()
    except UnreadableResultFile as exc:
        raise PluginError(str(exc)) from None


def write_page(module_name: str) -> None:
    module = importlib.import_module(f"tilax_report.pages.{module_name}")
    markdown = module.build(stored_results())
    with mkdocs_gen_files.open(PAGES[module_name], "w") as page:
        page.write(markdown)


def write_raw_data() -> None:
    """Byte-for-byte copies of every stored file, for download from the raw-data page."""
    results = stored_results()
    for name in results.files["source_file"]:
        with mkdocs_gen_files.open(f"{RAW_DATA_DIR}/{name}", "wb") as copy:
            copy.write((results.data_dir / "results" / name).read_bytes())


def write_vega_bundle() -> None:
    """Vega, Vega-Lite and vega-embed as one script, so charts render with no network."""
    header = (
        f"/* Vega {vl_convert.get_vega_version()}, Vega-Lite {VEGA_LITE_VERSION}, vega-embed "
        f"{vl_convert.get_vega_embed_version()} (BSD-3-Clause, the Vega project), bundled by "
        "vl-convert-python at site build time. */\n"
    )
    with mkdocs_gen_files.open(VEGA_BUNDLE, "w") as bundle:
        bundle.write(header + vl_convert.javascript_bundle(vl_version=VEGA_LITE_VERSION))
