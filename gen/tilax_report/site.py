"""What the gen/ script calls: write the report pages, their nav and the assets into the build.

One way through: stored files -> `load` (one loader per format) -> the tidy table -> analysis
modules (numbers) -> `pages` (all wording) -> Markdown files in the mkdocs build.
"""

from __future__ import annotations

import importlib
from pathlib import PurePosixPath

import mkdocs_gen_files
import vl_convert
from mkdocs.exceptions import PluginError

from .front import HOME_MARKER, home_page
from .load import StoredResults, UnreadableResultFile, load_results
from .pages import HAND_WRITTEN, PAGES

RAW_DATA_DIR = "reports/data"
NAV_FILE = "reports/SUMMARY.md"
VEGA_BUNDLE = "assets/vendor/vega-bundle.js"
VEGA_LITE_VERSION = "6.4"  # matches the Vega-Lite schema Altair 6 writes
HOME_PAGE = "index.md"


def stored_results() -> StoredResults:
    """The loaded results; an unreadable stored file fails the build, naming file and reason."""
    try:
        return load_results()
    except UnreadableResultFile as exc:
        raise PluginError(str(exc)) from None


def page_module(name: str):
    return importlib.import_module(f"tilax_report.pages.{name}")


def write_site() -> None:
    """Everything generated: raw copies, the Vega bundle, every page in `PAGES`, the nav."""
    results = stored_results()  # first: an unreadable stored file fails the build at once
    write_raw_data(results)
    write_vega_bundle()
    write_home(results)
    for name in PAGES:
        module = page_module(name)
        with mkdocs_gen_files.open(module.PATH, "w") as page:
            page.write(module.build(results))
    write_nav()


def write_home(results: StoredResults) -> None:
    """The hand-written home page with the generated headline at its marker."""
    with mkdocs_gen_files.open(HOME_PAGE, "r") as page:
        hand_written = page.read()
    if HOME_MARKER not in hand_written:
        raise PluginError(f"docs/{HOME_PAGE} has lost the headline's marker line "
                          f"{HOME_MARKER!r}")
    with mkdocs_gen_files.open(HOME_PAGE, "w") as page:
        page.write(home_page(results, hand_written))


def nav_lines() -> list[str]:
    """The literate-nav list of the reports section: `PAGES` in order, then the hand-written
    pages (links relative to reports/)."""
    entries = [(page_module(name).TITLE, page_module(name).PATH) for name in PAGES]
    entries += list(HAND_WRITTEN.items())
    folder = PurePosixPath(NAV_FILE).parent
    return [f"* [{title}]({PurePosixPath(path).relative_to(folder)})"
            for title, path in entries]


def write_nav() -> None:
    with mkdocs_gen_files.open(NAV_FILE, "w") as nav:
        nav.write("\n".join(nav_lines()) + "\n")


def write_raw_data(results: StoredResults) -> None:
    """Byte-for-byte copies of every stored file, for download from the raw-data page."""
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
