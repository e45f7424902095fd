"""mkdocs-gen-files script: the stored files and the vendored Vega bundle, into the site."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tilax_report import site  # noqa: E402

site.write_raw_data()  # first: an unreadable stored file fails the build before anything else
site.write_vega_bundle()
